"""Goodput under chaos: a campaign with a fault every ~N seconds, its wall time split by the
ledger (``pretrain.views.goodput``).

    python bench/chaos_goodput.py [--minutes 10] [--fault-every 120] [--step-s S] [--workdir DIR]

One stage on two local nodes of one CPU worker each (flash checkpoints). The faults cycle
through the spec's chaos drills: a worker killed, a worker hung, a NaN loss, a node lost (it
comes back after its re-check). Drills fire at steps, so the step time is measured first by a
short fault-free calibration campaign (or given with ``--step-s``); the stage gets as many steps
as fill ``--minutes``. Prints the goodput table (seconds and share per category) and each fault
with its recovery and time lost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")  # a loaded machine starts it slowly
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, run alone or by python -m bench
BENCH = {
    "title": "Goodput under chaos",
    "order": 70,
    "quick": ["--minutes", "1", "--fault-every", "20"],
    "full": [],
    "timeout_s": 2400,
}

from bench.results import Check, report  # noqa: E402
from flows.campaign import pretrain_campaign  # noqa: E402
from pretrain.spec.campaign import parse_spec  # noqa: E402
from pretrain.views.goodput import ALL  # noqa: E402
from trainer.job.reporting import read_all  # noqa: E402

DATA = {
    "sources": ["{stdlib}/*.py"],
    "max_bytes": 2_000_000,
    "tokenizer": {"vocab_size": 512},
}  # a tiny corpus overfits
FAULTS = (
    {"kind": "kill_worker", "rank": 1},
    {"kind": "hang_worker", "rank": 0},
    {"kind": "nan_loss"},
    {"kind": "kill_node", "node": 1},
)


def spec(workdir: Path, model: dict, steps: int, chaos: list[dict], memory_interval: int | None = None):
    return parse_spec(
        {
            "name": "chaos-goodput",
            "workdir": str(workdir),
            "data": DATA,
            "model": model,
            "chaos": chaos,
            "cluster": {
                "workers_per_node": 1,
                "nodes_min": 1,
                "nodes_max": 2,
                "max_restarts": 2 + 2 * len(chaos),
                "rejoin_after_s": 20,
            },
            "stages": [{"name": "main", "steps": steps, "seq_len": 64, "micro_batch": 4, "warmup_steps": 5}],
            "checkpoint": {"interval": 50, **({} if memory_interval is None else {"memory_interval": memory_interval})},
            "fault_tolerance": {"step_timeout_s": 10},
            "validation": {
                "probe_tolerance": 2.0
            },  # the gate looks for divergence; a small model on little data overfits
            "resume": {"max_attempts": 2 + len(chaos)},
        }
    )


def drills(steps: int, every_steps: int) -> list[dict]:
    """A fault every ``every_steps`` steps, cycling through :data:`FAULTS` (none in the last stretch)."""
    return [
        {**FAULTS[i % len(FAULTS)], "step": step}
        for i, step in enumerate(range(every_steps, steps - every_steps // 2, every_steps))
    ]


def calibrate(root: Path, model: dict) -> float:
    """The median step time of a short fault-free campaign of the same model and cluster."""
    s = spec(root / "calibration", model, 30, [])
    pretrain_campaign(spec=s)
    times = [m["step_time"] for m in read_all(s.workdir_path / "jobs" / "main" / "attempt_000" / "metrics.jsonl")]
    return statistics.median(times)


def print_goodput(status: dict) -> dict:
    g = status["goodput"]
    print(f"\ncampaign wall {g['wall_s']:.1f}s, goodput {100 * (g['goodput'] or 0):.1f} %")
    for c in ALL:
        part = g["parts_s"][c]
        print(f"  {c:22s} {part:9.1f}s {100 * part / g['wall_s']:6.1f} %")
    stage = status["stages"][0]["goodput"]
    print(f"stage main: wall {stage['wall_s']:.1f}s, goodput {100 * (stage['goodput'] or 0):.1f} %")
    print(f"\n{'fault':16s} {'action':42s} {'recovery_s':>10s} {'time lost s':>11s}")
    for f in status["stages"][0]["failures"]:
        print(f"{f['cause']:16s} {f['action'][:42]:42s} {str(f.get('recovery_s')):>10s} {f['time_lost_s']:>11.2f}")
    return stage


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="Training time to fill (default 10).")
    p.add_argument("--fault-every", type=float, default=120.0, help="Seconds between faults (default 120).")
    p.add_argument("--step-s", type=float, default=None, help="Step time (default: measured by a calibration run).")
    p.add_argument("--workdir", default=None)
    p.add_argument(
        "--memory-interval",
        type=int,
        default=None,
        help="Steps between memory snapshots (default: the spec's default, checkpoint.memory_interval).",
    )
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    a = p.parse_args()
    root = Path(a.workdir or tempfile.mkdtemp(prefix="pretrain-chaos-goodput-"))
    model = {"n_layer": a.layers, "n_head": 4, "d_model": a.d_model, "max_seq_len": 64}
    step_s = a.step_s or calibrate(root, model)
    steps = max(20, int(a.minutes * 60 / step_s))
    every = max(5, int(a.fault_every / step_s))
    chaos = drills(steps, every)
    campaign = spec(root / "campaign", model, steps, chaos, a.memory_interval)
    print(
        f"step ≈ {step_s:.3f}s: {steps} steps, a fault every {every} steps ({len(chaos)} faults), a memory snapshot "
        f"every {campaign.checkpoint.memory_interval} steps; workdir {root}"
    )
    stage = print_goodput(pretrain_campaign(spec=campaign))
    report(
        [
            Check(
                f"stage goodput with a fault every {a.fault_every:.0f} s",
                round(stage["goodput"] or 0.0, 3),
                0.95,
                ">=",
                why_missed(stage, len(chaos), step_s),
            )
        ],
        step_s=round(step_s, 3),
        steps=steps,
        faults=len(chaos),
        memory_interval=campaign.checkpoint.memory_interval,
    )


def why_missed(stage: dict, faults: int, step_s: float) -> str:
    """Where the stage's time went besides training: the faults' own cost and the largest losses."""
    parts, wall = stage.get("parts_s") or {}, stage.get("wall_s") or 0.0
    cost = sum(parts.get(c, 0.0) for c in ("detection", "recovery", "recomputation"))
    losses = sorted(((c, parts.get(c, 0.0)) for c in ALL if c != "productive"), key=lambda x: -x[1])
    return (
        f"{faults} faults cost {cost:.0f} s ({cost / wall if wall else 0:.1%} of the stage: detection, recovery, "
        f"recomputation); the largest losses: {', '.join(f'{c} {x:.0f} s' for c, x in losses[:3])} — on a "
        f"{step_s:.2f} s step a snapshot's blocking copy and each step's bookkeeping weigh far more than on a "
        "real-size step"
    )


if __name__ == "__main__":
    main()
