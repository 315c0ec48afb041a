"""Chaos drills end to end: every injected fault is detected, classified and recovered, and
recovery is exact — the parameters match a fault-free run bit for bit."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
import torch
from mlflow.tracking import MlflowClient
from prefect.settings import PREFECT_API_URL

from flows.campaign import pretrain_campaign
from pretrain.run.jobs import checkpoint_store, job_config
from pretrain.state.ledger import Ledger
from pretrain.views.goodput import ALL
from support.campaigns import (
    assert_no_duplicate_metric_steps,
    campaign_events,
    final_model,
    seed_data,
    small_spec,
    wait_for,
)
from trainer.job.config import JobConfig
from trainer.job.reporting import read_all
from trainer.resilience.chaos import WorkerChaos

STAGE = [{"name": "main", "steps": 30, "seq_len": 32, "micro_batch": 4, "warmup_steps": 3}]
DRILLS = [
    {"kind": "kill_worker", "step": 8, "rank": 1},
    {"kind": "kill_saver", "step": 11},
    {"kind": "hang_worker", "step": 14, "rank": 0},
    {"kind": "nan_loss", "step": 21, "rank": 1},
]


def chaos_spec(path, prepared_data, **overrides):
    body = {
        "stages": STAGE,
        "checkpoint": {"interval": 10, "memory_interval": 2, "keep": 3},
        "cluster": {"workers_per_node": 2, "max_restarts": 5},
        "fault_tolerance": {"step_timeout_s": 3},
        **overrides,
    }
    spec = small_spec(path, **body)
    seed_data(spec, prepared_data)
    return spec


def flow_log(spec) -> Path:
    """What the drilled campaign's flow and task runs logged (the ``prefect`` loggers' records)."""
    return spec.workdir_path.with_name(spec.workdir_path.name + "-flow-runs.log")  # beside the workdir, not in it


@pytest.fixture(scope="module")
def drilled(prefect_harness, prepared_data, tmp_path_factory):
    spec = chaos_spec(tmp_path_factory.mktemp("chaos"), prepared_data, chaos=DRILLS)
    handler = logging.FileHandler(flow_log(spec))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logging.getLogger("prefect").addHandler(handler)
    try:
        return spec, pretrain_campaign(spec=spec)
    finally:
        logging.getLogger("prefect").removeHandler(handler)
        handler.close()


def test_the_flow_run_log_says_each_recovery_before_the_jobs_incident_summary(drilled):
    """Each recovery is a line in the flow run's log as it happens (read from the job's events
    while it trains, every 2 s), ahead of the incidents the flow records when the job has ended."""
    spec, _ = drilled
    lines = flow_log(spec).read_text().splitlines()
    live = [i for i, line in enumerate(lines) if "stage main: rank 1 lost: a warm spare took over" in line]
    hang = [i for i, line in enumerate(lines) if "stage main: rank 0 hung (no progress in 'step'" in line]
    saver = [i for i, line in enumerate(lines) if "stage main: the checkpoint saver was restarted" in line]
    nan = [i for i, line in enumerate(lines) if "stage main: the loss of step 21 was anomalous: rolled back" in line]
    summary = [
        i for i, line in enumerate(lines) if "stage main: worker_killed — " in line
    ]  # the incidents, at the job's end
    assert len(live) == len(hang) == len(saver) == len(nan) == len(summary) == 1, "\n".join(lines[-60:])
    assert max(live + hang + saver + nan) < summary[0]


def test_every_drill_fires_once_and_the_campaign_completes(drilled):
    spec, status = drilled
    assert status["status"] == "completed" and status["stages"][0]["steps_done"] == 30
    events = read_all(spec.workdir_path / "jobs" / "main" / "attempt_000" / "events.jsonl")
    fired = sorted((e["kind"], e["step"]) for e in events if e["event"] == "chaos")
    assert [k for k, _ in fired] == sorted(d["kind"] for d in DRILLS)
    assert status["stages"][0]["attempts"] == 1  # all recovered inside the job
    assert_no_duplicate_metric_steps(spec.tracking_uri)


def test_a_killed_saver_is_restarted_and_what_it_commits_afterwards_verifies(drilled):
    """The kill_saver drill (SIGKILL at step 11): the agent starts a new saver, which commits the
    later checkpoints up to the last step; every committed checkpoint verifies."""
    spec, _ = drilled
    events = read_all(spec.workdir_path / "jobs" / "main" / "attempt_000" / "events.jsonl")
    assert sum(e["event"] == "saver_start" for e in events) == 2
    [killed] = [e["step"] for e in events if e["event"] == "chaos" and e["kind"] == "kill_saver"]
    later = [e["step"] for e in events if e["event"] == "checkpoint" and e["step"] > killed]
    assert later and later[-1] == 30
    store = checkpoint_store(spec, "main")
    assert store.committed_steps() and all(store.verify(step) == [] for step in store.committed_steps())


def test_failures_are_classified_with_recovery_times(drilled):
    spec, status = drilled
    failures = status["stages"][0]["failures"]
    causes = [f["cause"] for f in failures]
    assert {"worker_killed", "saver_failure", "hang", "nonfinite_loss"} <= set(causes)
    paths = {
        "nonfinite_loss": "in_process",  # a NaN loses no process: rolled back in it
        "worker_killed": "spare",  # the other worker is kept, a warm spare takes the lost rank
        "hang": "spare",
    }  # the hung worker alone is killed; the one waiting for it in a collective is kept
    for f in failures:
        if path := paths.get(f["cause"]):
            assert f["recovery_path"] == path and f["recovery_s"] > 0
            assert f["action"].startswith(
                {
                    "in_process": rollback_source(spec),
                    "restart": "restart workers from memory",
                    "spare": "replace rank(s) [",
                }[path]
            )
            assert f["time_lost_s"] >= f["recovery_s"]


def rollback_source(spec) -> str:
    """What the NaN's rollback names: memory (the snapshots every two steps), unless a rank's
    snapshot since the hang's recovery was skipped (both its slots busy: a loaded machine), when
    the committed checkpoint may be the newest state every rank holds."""
    events = read_all(spec.workdir_path / "jobs" / "main" / "attempt_000" / "events.jsonl")
    hang, nan = (
        [e["step"] for e in events if e["event"] == "chaos" and e["kind"] == kind]
        for kind in ("hang_worker", "nan_loss")
    )
    skipped = [e for e in events if e["event"] == "snapshot_skipped" and hang[0] <= e["step"] <= nan[0]]
    return "roll back in process to " + ("" if skipped else "memory")


def test_every_worker_replaced_counts_as_a_restart_and_sends_a_restarted_event(drilled):
    """The kill and the hang each replace a worker (a spare, or all workers when the fast path
    fell back): the stage's restarts count them and each sends ``pretrain.stage.restarted``."""
    spec, status = drilled
    stage = status["stages"][0]
    replaced = [
        f["recovery_path"] for f in stage["failures"] if f.get("recovery_path") in ("spare", "replacement", "restart")
    ]
    assert len(replaced) >= 2 and stage["restarts"] == len(replaced)

    def restarted():
        found = [
            e["payload"]
            for e in campaign_events(PREFECT_API_URL.value(), spec.name)
            if e["event"] == "pretrain.stage.restarted" and e["resource"]["pretrain.workdir"] == str(spec.workdir_path)
        ]
        return found if len(found) >= len(replaced) else None

    events = wait_for(restarted, 30, "the restarted events", interval=0.5)
    assert all(e["in_job"] for e in events)
    assert sorted(e["recovery_path"] for e in events) == sorted(replaced)
    # a hung worker replaced: its event says where it hung (the drill's wait)
    hung = [f for f in stage["failures"] if f["cause"] == "hang" and f.get("recovery_path") in ("spare", "replacement")]
    wheres = [e.get("where", "") for e in events if e.get("cause") == "hang"]
    assert len(wheres) == len(hung) and all(" from before_step (trainer/resilience/chaos.py:" in w for w in wheres)


def test_goodput_parts_add_up_to_the_wall_time_of_a_drilled_campaign(drilled):
    spec, status = drilled
    for split in (status["goodput"], status["stages"][0]["goodput"]):
        assert split["known"] and abs(sum(split["parts_s"].values()) - split["wall_s"]) <= 0.01 * split["wall_s"]
        assert all(v >= 0 for v in split["parts_s"].values()) and 0 < split["goodput"] < 1
    parts = status["stages"][0]["goodput"]["parts_s"]
    assert parts["detection"] > 0 and parts["recovery"] > 0 and parts["validation_eval"] > 0
    spans = Ledger.read(spec.layout).record.spans
    [run] = [s for s in spans if s.kind == "run"]
    [job] = [s for s in spans if s.kind == "job"]
    assert run.start < job.start < job.end <= run.end  # the wall time measured covers the training


def _valid_png(path) -> tuple[int, int]:
    """The image's (height, width): matplotlib decodes it, so it is a whole, valid PNG."""
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n", path
    return matplotlib.image.imread(path).shape[:2]


def test_goodput_and_pictures_are_logged_to_the_mlflow_parent_run(drilled, tmp_path):
    spec, status = drilled
    client = MlflowClient(spec.tracking_uri)
    run_id = status["mlflow"]["parent_run_id"]
    metrics = client.get_run(run_id).data.metrics
    assert 0 < metrics["goodput"] < 1 and metrics["goodput_recovery_s"] > 0
    assert {f"goodput_{c}_s" for c in ALL} <= set(metrics)
    assert sorted(a.path for a in client.list_artifacts(run_id, "report")) == [
        "report/goodput.png",
        "report/loss_vs_tokens.png",
    ]
    for name in ("goodput.png", "loss_vs_tokens.png"):
        h, w = _valid_png(client.download_artifacts(run_id, f"report/{name}", str(tmp_path)))
        assert h > 100 and w > 400
    logged = json.loads(open(client.download_artifacts(run_id, "goodput.json", str(tmp_path))).read())
    assert logged["campaign"]["parts_s"].keys() == set(ALL)


def test_report_command_writes_the_pictures_and_a_page(drilled, tmp_path):
    spec, _ = drilled
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pretrain.cli.app",
            "report",
            "--workdir",
            str(spec.workdir_path),
            "--out",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    for name in ("loss_vs_tokens.png", "goodput.png"):
        _valid_png(tmp_path / "r" / name)
    page = (tmp_path / "r" / "report.html").read_text()
    assert "src='loss_vs_tokens.png'" in page and "src='goodput.png'" in page and "recomputation" in page
    missing = subprocess.run(
        [sys.executable, "-m", "pretrain.cli.app", "report", "--workdir", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and "no campaign in" in missing.stderr and "Traceback" not in missing.stderr
    (tmp_path / "notes.txt").write_text("mine")
    onto_a_file = subprocess.run(
        [
            sys.executable,
            "-m",
            "pretrain.cli.app",
            "report",
            "--workdir",
            str(spec.workdir_path),
            "--out",
            str(tmp_path / "notes.txt"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert onto_a_file.returncode == 2 and "Traceback" not in onto_a_file.stderr, onto_a_file.stderr
    assert "cannot write the report to" in onto_a_file.stderr and "[Errno" not in onto_a_file.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_hang_is_detected_by_the_heartbeat_monitor(drilled):
    spec, _ = drilled
    events = read_all(spec.workdir_path / "jobs" / "main" / "attempt_000" / "events.jsonl")
    [hang] = [e for e in events if e["event"] == "hang"]
    assert 0 in hang["ranks"] and hang["phase"] == "step" and hang["stalled_s"] >= 3


def test_nan_step_is_rolled_back_and_its_samples_skipped(drilled):
    spec, _ = drilled
    [skip] = read_all_skips(spec)
    assert skip["kind"] == "nonfinite" and skip["step"] == 21
    assert skip["end"] - skip["start"] == 2 * 4  # one global batch: 2 workers × micro_batch 4


def test_nan_rollback_keeps_every_worker_process(drilled):
    """Both ranks roll the NaN step back in the processes that saw it: neither is restarted."""
    spec, _ = drilled
    events = read_all(spec.workdir_path / "jobs" / "main" / "attempt_000" / "events.jsonl")
    [rollback] = [e for e in events if e["event"] == "rollback" and e["path"] == "in_process"]
    assert rollback["path"] == "in_process" and rollback["anomaly_step"] == 21
    for rank in (0, 1):
        last_start = [e for e in events if e["event"] == "start" and e["rank"] == rank][-1]
        [done] = [e for e in events if e["event"] == "done" and e["rank"] == rank]
        assert last_start["time"] < rollback["time"] and done["pid"] == last_start["pid"]


def read_all_skips(spec):
    return json.loads((spec.workdir_path / "jobs" / "main" / "skips.json").read_text())


def test_recovery_is_bitwise_exact(drilled, prepared_data, tmp_path):
    """The drilled run ends with the same parameters, bit for bit, as a fault-free run that
    skips the same sample window."""
    spec, _ = drilled
    [skip] = read_all_skips(spec)
    clean = chaos_spec(
        tmp_path, prepared_data, skip_samples=[{"stage": "main", "start": skip["start"], "end": skip["end"]}]
    )
    clean_stage = pretrain_campaign(spec=clean)["stages"][0]
    assert clean_stage["failures"] == [] and clean_stage["goodput"]["goodput"] > 0  # a fault-free stage's goodput
    assert_no_duplicate_metric_steps(clean.tracking_uri)
    a, b = final_model(spec), final_model(clean)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    unskipped = chaos_spec(tmp_path / "unskipped", prepared_data)
    pretrain_campaign(spec=unskipped)
    assert not all(torch.equal(final_model(unskipped)[k], a[k]) for k in a)  # the skip really changed the data


def test_loss_spike_is_rolled_back_and_skipped(prefect_harness, prepared_data, tmp_path):
    """With ``rollback_in_process`` off, the workers are restarted and roll back on start-up."""
    spec = chaos_spec(
        tmp_path,
        prepared_data,
        chaos=[{"kind": "loss_spike", "step": 25, "factor": 20}],
        fault_tolerance={"spike_min_steps": 10, "spike_window": 20, "spike_zscore": 8, "rollback_in_process": False},
    )
    status = pretrain_campaign(spec=spec)
    stage = status["stages"][0]
    assert status["status"] == "completed" and stage["steps_done"] == 30
    assert [(f["cause"], f.get("recovery_path")) for f in stage["failures"]] == [("loss_spike", "restart")]
    assert_no_duplicate_metric_steps(spec.tracking_uri)
    [skip] = read_all_skips(spec)
    assert skip["kind"] == "spike" and skip["step"] == 25


def test_drills_reach_the_workers_typed_with_the_specs_values(tmp_path):
    """job.json carries each drill with its kind's fields only, and the workers act on the
    spec's values (a slow_worker's delay, a loss_spike's factor), not on defaults of their own."""
    spec = small_spec(
        tmp_path,
        chaos=[
            {"kind": "slow_worker", "rank": 1},
            {"kind": "loss_spike", "step": 3, "rank": 1},
            {"kind": "kill_node", "step": 2},
            {"kind": "corrupt_checkpoint", "step": 4},
        ],
    )
    job = JobConfig.from_dict(json.loads(job_config(spec, 0, 0, None, 512).to_json()))  # as a worker reads it
    assert [sorted(vars(d)) for d in job.chaos] == [
        ["delay_s", "kind", "rank", "step"],
        ["factor", "kind", "rank", "step"],
        ["kind", "node", "step"],
        ["kind", "step"],
    ]
    fired = []
    worker = WorkerChaos(job.chaos, tmp_path / "jobs" / "warmup" / "attempt_000", rank=1, report=fired.append)
    assert worker.check_delay() == spec.chaos[0].delay_s == 0.2
    assert worker.loss_factor(3) == spec.chaos[1].factor == 20.0
    assert [e["kind"] for e in fired] == ["loss_spike"]


@pytest.mark.slow
def test_the_builtin_drills_campaign_recovers_each_fault_by_its_own_path(tmp_path):
    """``pretrain run builtin:drills`` (README): the kill and the hang are taken by warm spares
    while the other worker keeps running, the NaN is rolled back in the processes, the saver is
    restarted, all in the job's first attempt; the run's last live line and the table agree on
    the restarts (the lost workers replaced)."""
    env = {**os.environ, "COLUMNS": "200"}
    run = subprocess.run(
        [sys.executable, "-m", "pretrain.cli.app", "run", "builtin:drills", "--workdir", str(tmp_path / "w")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert run.returncode == 0 and "Traceback" not in run.stderr + run.stdout, run.stderr[-3000:]
    status = json.loads(
        subprocess.run(
            [sys.executable, "-m", "pretrain.cli.app", "status", "--workdir", str(tmp_path / "w"), "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
    )
    [stage] = status["stages"]
    assert stage["status"] == "completed" and stage["attempts"] == 1
    assert [(f["cause"], f.get("recovery_path")) for f in stage["failures"]] == [
        ("worker_killed", "spare"),
        ("hang", "spare"),
        ("nonfinite_loss", "in_process"),
        ("saver_failure", None),
    ]
    assert stage["restarts"] == 2
    assert "restarts 2," in run.stdout + run.stderr and "restarts 4" not in run.stdout + run.stderr
    assert "Nones" not in run.stdout + run.stderr
    assert "stage main: rank 1 lost: a warm spare took over" in run.stdout + run.stderr  # as it happened
