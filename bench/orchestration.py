"""Orchestration overhead: the demo campaign through Prefect (`pretrain run`) vs the trainer
launched directly (`python -m trainer.launch`) for the same stages and steps.

    python bench/orchestration.py [--quick] [--workdir DIR]

1. `pretrain run` on the built-in demo (``builtin:tiny``; ``--quick``: the same shape, a few
   steps on a small corpus) in a fresh work directory, its wall time measured from outside
   and each output line stamped with its arrival time.
2. Each stage's job, as the campaign wrote it (``jobs/<stage>/attempt_000/job.json``), launched
   again directly through the node agent with fresh checkpoint, job and shared-memory
   directories (the same data set, already prepared; each stage starting from the previous
   direct stage's checkpoint), one after the other: the wall time the trainer itself needs.
3. Where the campaign's time goes, from the arrival times of Prefect's log lines: the start
   (CLI imports, the Prefect API server, the flow run created: until the flow's first line),
   each subflow (data preparation, node check, stages, checkpoint validation, evaluation,
   export …), within the stages the training jobs and the validation gate, the campaign
   flow's own longer tasks (its MLflow run, export, registration), what follows the flow (the
   status table, the API server's stop), and the rest (Prefect between tasks, short tasks).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's code, run alone or by python -m bench

BENCH = {
    "title": "Orchestration overhead: pretrain run vs the trainer launched directly",
    "order": 40,
    "quick": ["--quick"],
    "full": [],
    "timeout_s": 1800,
}
TARGET = 1.10
QUICK = {
    "data": {"sources": ["{stdlib}/json/*.py"], "max_bytes": 300_000, "tokenizer": {"vocab_size": 512}},
    "model": {"n_layer": 2, "n_head": 2, "d_model": 64, "max_seq_len": 128},
    "steps": {"warmup": 6, "main": 12},
}


def demo_spec(workdir: Path, quick: bool) -> Path:
    """The demo campaign's spec (quick: smaller), written as a file in ``workdir``."""
    import yaml

    spec = yaml.safe_load((ROOT / "pretrain" / "builtin" / "tiny.yaml").read_text())
    spec["workdir"] = str(workdir / "campaign")
    if quick:
        spec["data"].update(QUICK["data"])
        spec["model"].update(QUICK["model"])
        for stage in spec["stages"]:
            stage["steps"] = QUICK["steps"].get(stage["name"], 6)
            stage["warmup_steps"] = min(stage["warmup_steps"], stage["steps"] // 2)
        spec["checkpoint"]["interval"] = 5
    path = workdir / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run_campaign(spec: Path, env: dict) -> tuple[float, list[tuple[float, str]], int]:
    """Wall seconds, (arrival second, line) of its output, exit status."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pretrain.cli.app", "run", str(spec)],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    lines = [(time.perf_counter() - t0, line.rstrip("\n")) for line in proc.stdout]
    code = proc.wait()
    return time.perf_counter() - t0, lines, code


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_direct(
    campaign: Path, stages: list[str], workers: int, threads: int, env: dict, root: Path
) -> dict[str, float]:
    """Each stage's job again, launched straight through the node agent; stage → wall seconds."""
    from trainer.job.config import JobConfig

    walls: dict[str, float] = {}
    ckpts: dict[str, str] = {}  # the campaign's checkpoint directory of a stage → the direct run's
    for stage in stages:
        job = JobConfig.load(campaign / "jobs" / stage / "attempt_000" / "job.json")
        here = root / stage
        shm = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="bench-orch-"))
        init_from = job.stage.init_from
        direct = job.amended(
            checkpoint={"location": str(here / "ckpt"), "shm_dir": str(shm)},
            job_dir=str(here / "job"),
            stage={"init_from": ckpts.get(init_from, init_from) if init_from else None},
            chaos=[],
        )
        ckpts[job.checkpoint.location] = direct.checkpoint.location
        (here / "job").mkdir(parents=True)
        path = here / "job" / "job.json"
        path.write_text(direct.to_json())
        cmd = [
            sys.executable,
            "-m",
            "trainer.launch",
            str(path),
            "--nproc",
            str(workers),
            "--rdzv-endpoint",
            f"127.0.0.1:{_port()}",
            "--run-id",
            f"direct-{stage}",
            "--threads",
            str(threads),
            "--rdzv-host",
        ]
        t0 = time.perf_counter()
        with open(here / "node0.log", "wb") as log:
            code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        walls[stage] = time.perf_counter() - t0
        shutil.rmtree(shm, ignore_errors=True)
        if code != 0:
            raise SystemExit(
                f"the direct launch of stage {stage} failed (exit {code}): see {here / 'node0.log'}:\n"
                + (here / "node0.log").read_text()[-1500:]
            )
    return walls


_BEGIN = re.compile(r"Flow run '(?P<run>[^']+)' - Beginning (?:sub)?flow run '[^']+' for flow '(?P<flow>[^']+)'")
_FLOW_END = re.compile(r"Flow run '(?P<run>[^']+)' - Finished in state")
_TASK = re.compile(r"Task run '(?P<name>(?P<task>[a-z0-9-]+?)-[0-9a-f]{3})' - (?P<what>Finished in state)?")
_PREFECT = re.compile(r"(Flow|Task) run '")  # a line of Prefect's (others: libraries' progress bars, warnings)
JOB_TASK, GATE_TASK = "run-training-job", "judge-checkpoints"


def breakdown(lines: list[tuple[float, str]], wall: float) -> list[tuple[str, float]]:
    """Seconds per part of the campaign, from the arrival times of Prefect's log lines: the
    start (CLI, API server, flow run created), each subflow kind (data, node check, stages,
    checkpoint validation, evaluation …) with the training jobs and the gate out of the stages,
    the campaign flow's own tasks of a second or more (MLflow run, export, registration …), and
    what follows the flow (status table, API server stop). A task's start is taken as Prefect's
    line before its first (Prefect logs no start line); the parts add up to the wall time."""
    began: dict[str, tuple[str, float]] = {}
    flows: dict[str, float] = {}
    task_start: dict[str, float] = {}
    in_stage: dict[str, float] = {}
    own: dict[str, float] = {}
    start, flow_end, previous = wall, wall, 0.0
    job_running, job_end = False, None  # a gate pass beside a running job costs the campaign no time
    for t, line in lines:
        if m := _BEGIN.search(line):
            if not began and start == wall:
                start = t
            began[m["run"]] = (m["flow"], t)
        elif (m := _FLOW_END.search(line)) and m["run"] in began:
            flow, t0 = began.pop(m["run"])
            if flow == "pretrain-campaign":
                flow_end = t
            else:
                flows[flow] = flows.get(flow, 0.0) + t - t0
        elif m := _TASK.search(line):
            task_start.setdefault(m["name"], previous)
            if m["task"] == JOB_TASK:
                job_running = not m["what"]
                job_end = t if m["what"] else job_end
            if m["what"]:
                t0 = task_start.pop(m["name"])
                if m["task"] == GATE_TASK:  # only what it adds after the job: passes beside training overlap it
                    t0 = t if job_running else max(t0, job_end if job_end is not None else t0)
                seconds = t - t0
                subflows = [f for f, _ in began.values() if f != "pretrain-campaign"]
                if m["task"] in (JOB_TASK, GATE_TASK) and "train-stage" in subflows:
                    in_stage[m["task"]] = in_stage.get(m["task"], 0.0) + seconds
                elif not subflows:
                    own[m["task"]] = own.get(m["task"], 0.0) + seconds
        if _PREFECT.search(line):
            previous = t
    parts = [("start: CLI, Prefect API server, flow run created", start)]
    for flow, seconds in sorted(flows.items(), key=lambda kv: -kv[1]):
        if flow == "train-stage":
            job, gate = in_stage.get(JOB_TASK, 0.0), in_stage.get(GATE_TASK, 0.0)
            parts += [
                ("train-stage: training jobs (node agents, workers)", job),
                ("train-stage: validation gate", gate),  # after the job: passes beside it are free
                ("train-stage: the rest (MLflow stage runs, resume point, …)", seconds - job - gate),
            ]
        else:
            parts.append((f"subflow {flow}", seconds))
    parts += [
        (f"campaign task {task}", seconds)
        for task, seconds in sorted(own.items(), key=lambda kv: -kv[1])
        if seconds >= 1.0
    ]
    parts.append(("after the flow: status table, API server stop", wall - flow_end))
    parts.append(("the rest: Prefect between tasks and subflows, short tasks", wall - sum(s for _, s in parts)))
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few steps of the demo's shape on a small corpus")
    ap.add_argument("--workdir", default=None, help="keep the runs here (default: a temporary directory)")
    a = ap.parse_args()
    from bench.results import Check, report

    root = Path(a.workdir or tempfile.mkdtemp(prefix="bench-orch-"))
    root.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PYTHONUNBUFFERED": "1",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": os.environ.get(
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120"
        ),
    }  # a loaded machine starts it slowly
    env.pop("BENCH_RESULT", None)
    try:
        spec = demo_spec(root, a.quick)
        import yaml

        raw = yaml.safe_load(spec.read_text())
        stages = [s["name"] for s in raw["stages"]]
        wall, lines, code = run_campaign(spec, env)
        (root / "campaign.log").write_text("".join(f"{t:8.2f} {line}\n" for t, line in lines))
        if code != 0:
            raise SystemExit(
                f"pretrain run failed (exit {code}); its output:\n" + "\n".join(line for _, line in lines[-20:])
            )
        threads = job_threads(Path(raw["workdir"]), stages[0])
        direct = run_direct(
            Path(raw["workdir"]), stages, raw["cluster"]["workers_per_node"], threads, env, root / "direct"
        )
    finally:
        if not a.workdir:
            shutil.rmtree(root, ignore_errors=True)
    total_direct = sum(direct.values())
    ratio = wall / total_direct
    steps = {s["name"]: s["steps"] for s in raw["stages"]}
    print(
        f"demo campaign{' (quick: fewer steps, smaller corpus and model)' if a.quick else ''}: "
        f"{', '.join(f'{k} {v} steps' for k, v in steps.items())}; {raw['cluster']['workers_per_node']} CPU workers"
    )
    print(f"{'pretrain run (Prefect flow, data prep, MLflow, gate, …)':58s} {wall:8.1f} s")
    for stage, s in direct.items():
        print(f"{'  direct: python -m trainer.launch, stage ' + stage:58s} {s:8.1f} s")
    print(f"{'trainer launched directly, all stages':58s} {total_direct:8.1f} s   → campaign = {ratio:.2f}× direct")
    print("where the campaign's time goes (from its output's arrival times):")
    parts = breakdown(lines, wall)
    for name, seconds in parts:
        print(f"  {name:56s} {seconds:8.1f} s")
    others = sorted(((n, x) for n, x in parts if "training jobs" not in n), key=lambda p: -p[1])
    why = f"{wall - total_direct:.0f} s beyond the direct run; the largest parts: " + "; ".join(
        f"{n} {x:.0f} s" for n, x in others[:4]
    )
    report(
        [Check("pretrain run / trainer launched directly, wall", round(ratio, 3), TARGET, "<=", why)],
        campaign_s=round(wall, 1),
        direct_s=round(total_direct, 1),
    )


def job_threads(workdir: Path, stage: str) -> int:
    """The torch threads per worker the campaign used (its node agent's ``--threads``)."""
    from trainer.job.config import JobConfig

    return JobConfig.load(workdir / "jobs" / stage / "attempt_000" / "job.json").cluster.threads_per_worker or 1


if __name__ == "__main__":
    main()
