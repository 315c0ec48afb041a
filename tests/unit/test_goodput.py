"""The goodput split (pretrain.views.goodput): every second of wall time in exactly one category, from
the ledger's spans and the jobs' real metrics/events files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pretrain.spec.layout import CampaignLayout
from pretrain.state.ledger import Ledger
from pretrain.state.schema import CampaignRecord
from pretrain.views.goodput import ALL, goodput_report, split
from pretrain.views.status import goodput_table

DATA = Path(__file__).parents[1] / "data"

# windows, intervals → parts (only the non-zero ones)
SPLITS = {
    "nothing covered: all idle": ([(0, 10)], [], {"idle": 10}),
    "a step inside its window": ([(0, 10)], [("productive", 2, 5)], {"productive": 3, "idle": 7}),
    "outside the window: not counted": (
        [(0, 10)],
        [("recovery", 8, 14), ("provisioning", -5, -1)],
        {"recovery": 2, "idle": 8},
    ),
    "overlap goes to the first category": (
        [(0, 10)],
        [("recovery", 0, 6), ("productive", 4, 8)],
        {"recovery": 4, "productive": 4, "idle": 2},
    ),
    "a window counted once when overlapping": (
        [(0, 6), (4, 10)],
        [("validation_eval", 3, 5)],
        {"validation_eval": 2, "idle": 8},
    ),
    "two windows with a gap": ([(0, 2), (5, 7)], [("data_preparation", 0, 7)], {"data_preparation": 4}),
    "empty interval ignored": ([(0, 4)], [("detection", 3, 3)], {"idle": 4}),
}


@pytest.mark.parametrize("case", SPLITS)
def test_split_puts_every_second_in_one_category(case):
    windows, intervals, expected = SPLITS[case]
    parts = split(windows, intervals)
    assert {k: v for k, v in parts.items() if v} == pytest.approx(expected)
    assert set(parts) == set(ALL)


def _lines(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _ledger(tmp_path: Path, spans: list[dict], failures: list[dict] = (), status: str = "completed") -> CampaignRecord:
    record = CampaignRecord.model_validate(
        {
            "campaign": "g",
            "campaign_id": "x",
            "spec_hash": "h",
            "status": status,
            "invocations": 1,
            "mlflow": {"tracking_uri": "sqlite:///m.db", "experiment": "e"},
            "stages": {
                "main": {
                    "status": "completed",
                    "steps": 6,
                    "checkpoints": str(tmp_path / "ckpt"),
                    "attempts": 2,
                    "restarts": 1,
                    "failures": list(failures),
                    "resumes": [],
                }
            },
            "spans": spans,
        }
    )
    return record


def _step(t: float, step: int, dt: float = 1.0, block: float | None = None) -> dict:
    return {"time": t, "step": step, "step_time": dt, "loss": 1.0, **({"ckpt_block_s": block} if block else {})}


def test_a_stage_with_an_in_job_restart_and_a_relaunch_is_split_exactly(tmp_path):
    """Timeline (seconds): run 0-40, data 0-2, node check 2-3, stage 3-40, job 0 4-20, job 1 24-36,
    validation 37-39. Job 0 steps 1-4 (1 s each, step 2 blocks 0.5 s), a hang drilled at 10, noticed at 12,
    workers back from step 2 at 13, step 3 again at 15, then the job dies at 20 (noticed at 20).
    Job 1 restarts from step 3 at 26, steps 4-6 until 29, the final flush until 30."""
    job0 = tmp_path / "jobs" / "main" / "attempt_000"
    _lines(
        job0 / "events.jsonl",
        [
            {"time": 5.0, "event": "start", "rank": 0, "step": 0, "source": "scratch"},
            {"time": 10.0, "event": "chaos", "kind": "hang_worker"},  # the drill: noticed only by the hang event
            {"time": 12.0, "event": "hang", "ranks": [0]},
            {"time": 13.0, "event": "start", "rank": 0, "step": 2, "source": "memory"},
        ],
    )
    _lines(
        job0 / "metrics.jsonl", [_step(6.0, 1), _step(7.5, 2, block=0.5), _step(8.5, 3), _step(9.5, 4), _step(15.0, 3)]
    )
    job1 = tmp_path / "jobs" / "main" / "attempt_001"
    _lines(
        job1 / "events.jsonl",
        [
            {"time": 26.0, "event": "start", "rank": 0, "step": 3, "source": "checkpoint"},
            {"time": 30.0, "event": "done", "rank": 0, "step": 6},
        ],
    )
    _lines(job1 / "metrics.jsonl", [_step(27.0, 4), _step(28.0, 5), _step(29.0, 6)])
    spans = [
        {"kind": "run", "start": 0.0, "end": 41.0},
        {"kind": "data_preparation", "start": 0.0, "end": 2.0},
        {"kind": "node_check", "start": 2.0, "end": 3.0},
        {"kind": "stage", "stage": "main", "start": 3.0, "end": 40.0},
        {"kind": "job", "stage": "main", "attempt": 0, "start": 4.0, "end": 20.0},
        {"kind": "job", "stage": "main", "attempt": 1, "start": 24.0, "end": 36.0},
        {"kind": "validation_eval", "stage": "main", "start": 37.0, "end": 39.0},
        {"kind": "registration", "start": 40.0, "end": 41.0},
    ]  # after the stage: the final model's
    failure = {"attempt": 0, "cause": "worker_killed", "in_job": False, "detected_at": 20.0, "time_lost_s": 0.1}
    report = goodput_report(_ledger(tmp_path, spans, [failure]), CampaignLayout(tmp_path))
    stage = report["stages"]["main"]
    parts = stage["parts_s"]
    # survived: steps 1, 2 (job 0), 3 (again at 15), 4-6 (job 1); redone: the first step 3 and step 4 of job 0
    assert parts["productive"] == pytest.approx(6.0) and parts["recomputation"] == pytest.approx(2.0)
    assert parts["checkpoint_blocking"] == pytest.approx(0.5 + 1.0)  # step 2's snapshot, job 1's final flush
    assert parts["detection"] == pytest.approx((12.0 - 9.5) + (20.0 - 15.0))  # hang; the job's death
    assert parts["recovery"] == pytest.approx((14.0 - 12.0) + (26.0 - 20.0))  # hang → step 3 again; death → job 1 steps
    assert parts["provisioning"] == pytest.approx(5.0 - 4.0)  # job 0's launch until its first step
    assert parts["validation_eval"] == 2.0 and parts["data_preparation"] == 0.0  # outside the stage's window
    assert stage["wall_s"] == pytest.approx(37.0) and sum(parts.values()) == pytest.approx(37.0)
    assert stage["goodput"] == pytest.approx(6.0 / 37.0, abs=1e-4)
    campaign = report["campaign"]
    assert campaign["wall_s"] == 41.0 and sum(campaign["parts_s"].values()) == pytest.approx(41.0)
    assert campaign["parts_s"]["registration"] == 1.0 and parts["registration"] == 0.0
    assert campaign["parts_s"]["data_preparation"] == 2.0 and campaign["parts_s"]["node_checks"] == 1.0
    assert all(v >= 0 for v in campaign["parts_s"].values())


def test_damaged_job_streams_are_skipped_not_fatal(tmp_path):
    job = tmp_path / "jobs" / "main" / "attempt_000"
    job.mkdir(parents=True)
    (job / "metrics.jsonl").write_bytes(b'{"time": 6, "step": 1, "step_time": 1.0}\n\x00\x00garbage\n{"step": "x"}\n')
    (job / "events.jsonl").write_bytes(b"[1, 2]\n")
    (tmp_path / "jobs" / "main" / "attempt_notanumber").mkdir()
    (tmp_path / "jobs" / "main" / "attempt_001" / "events.jsonl").mkdir(parents=True)  # a directory, not a stream
    spans = [{"kind": "run", "start": 0.0, "end": 10.0}, {"kind": "stage", "stage": "main", "start": 0.0, "end": 10.0}]
    stage = goodput_report(_ledger(tmp_path, spans), CampaignLayout(tmp_path))["stages"]["main"]
    assert stage["parts_s"]["productive"] == 1.0 and sum(stage["parts_s"].values()) == pytest.approx(10.0)


def test_a_launch_whose_records_are_lost_counts_as_idle_not_provisioning(tmp_path):
    """The orchestrator's disk was lost at 20 with job 0 (launched at 4) on it; a run from another
    workdir launched job 1 at 60, stepping from 62. Job 0's span never closed (its run died)."""
    job1 = tmp_path / "jobs" / "main" / "attempt_001"
    _lines(job1 / "events.jsonl", [{"time": 61.0, "event": "start", "rank": 0, "step": 3, "source": "checkpoint"}])
    _lines(job1 / "metrics.jsonl", [_step(62.0, 4), _step(63.0, 5)])
    spans = [
        {"kind": "run", "start": 0.0},
        {"kind": "stage", "stage": "main", "start": 3.0},
        {"kind": "job", "stage": "main", "attempt": 0, "start": 4.0},
        {"kind": "run", "start": 58.0},
        {"kind": "stage", "stage": "main", "start": 59.0},
        {"kind": "job", "stage": "main", "attempt": 1, "start": 60.0},
    ]
    stage = goodput_report(_ledger(tmp_path, spans, status="running"), CampaignLayout(tmp_path), now=64.0)["stages"][
        "main"
    ]
    assert stage["parts_s"]["provisioning"] == pytest.approx(61.0 - 60.0)  # job 1's launch only
    assert stage["parts_s"]["productive"] == pytest.approx(2.0)
    assert stage["parts_s"]["idle"] == pytest.approx(61.0 - 2.0 - 1.0)
    assert [m for m in stage["missing"] if "no records of job attempt(s) 0 in" in m and "counts as idle" in m]
    fresh = [
        {"kind": "run", "start": 0.0},
        {"kind": "stage", "stage": "main", "start": 0.0},
        {"kind": "job", "stage": "main", "attempt": 2, "start": 63.5},
    ]  # just launched: nothing written yet
    stage = goodput_report(_ledger(tmp_path, fresh, status="running"), CampaignLayout(tmp_path), now=64.0)["stages"][
        "main"
    ]
    assert stage["parts_s"]["provisioning"] == pytest.approx(0.5) and stage["missing"] == []


def test_open_spans_end_now_while_running_and_at_the_last_known_time_after_a_crash(tmp_path):
    spans = [{"kind": "run", "start": 0.0}, {"kind": "data_preparation", "start": 1.0, "end": 3.0}]
    running = goodput_report(_ledger(tmp_path, spans, status="running"), CampaignLayout(tmp_path), now=50.0)
    assert running["campaign"]["wall_s"] == 50.0
    crashed = goodput_report(_ledger(tmp_path, spans, status="crashed"), CampaignLayout(tmp_path), now=50.0)
    assert crashed["campaign"]["wall_s"] == 3.0


def test_a_ledger_of_the_release_before_reports_goodput_unknown(tmp_path):
    shutil.copy(DATA / "ledger_v1_release_before.json", tmp_path / "ledger.json")
    record = Ledger.read(CampaignLayout(tmp_path)).record
    report = goodput_report(record, CampaignLayout(tmp_path))
    assert report["campaign"]["known"] is False and report["campaign"]["goodput"] is None
    assert "release before goodput was recorded" in report["campaign"]["missing"][0]
    assert all(s["known"] is False for s in report["stages"].values())
    text = goodput_table(
        {"stages": [{"name": n, "goodput": g} for n, g in report["stages"].items()], "goodput": report["campaign"]}
    )
    assert text.startswith("goodput: unknown — the ledger has no timed spans")


def test_runs_of_a_release_before_are_reported_as_not_measured(tmp_path):
    record = _ledger(tmp_path, [{"kind": "run", "start": 0.0, "end": 10.0}])
    record.invocations = 3  # two runs before this release, one measured
    campaign = goodput_report(record, CampaignLayout(tmp_path))["campaign"]
    assert campaign["known"] and campaign["wall_s"] == 10.0
    assert campaign["missing"] == [
        "2 earlier run(s) of the campaign were not measured (a release before goodput was "
        "recorded): the wall time counts the measured runs only"
    ]


def test_timed_spans_are_written_to_the_ledger_and_closed_when_the_block_fails(tmp_path):
    ledger = Ledger(CampaignLayout(tmp_path), _ledger(tmp_path, []))
    ledger.save()
    with ledger.timed("run"):
        with pytest.raises(RuntimeError):
            with ledger.timed("job", "main", 0):
                raise RuntimeError("the job broke")
    run, job = Ledger.read(CampaignLayout(tmp_path)).record.spans  # as written to ledger.json
    assert (run.kind, job.kind, job.stage, job.attempt) == ("run", "job", "main", 0)
    assert run.start <= job.start <= job.end <= run.end
    on_disk = json.loads((tmp_path / "ledger.json").read_text())["spans"]
    assert set(on_disk[0]) == {"kind", "start", "end"}  # no keys it was not given


@pytest.mark.parametrize("event, redone", [("rollback", {5, 6}), ("start", {5, 6}), ("checkpoint", set())])
def test_steps_redone_after_an_in_process_rollback_are_recomputation(event, redone):
    """An in-process rollback (no new worker process, so no start event) sends training back
    like a restart: the steps after the restored one were computed twice."""
    from pretrain.views.goodput import JobStreams, step_intervals
    from trainer.job.events import EventKind

    metrics = [{"time": float(s), "step": s, "step_time": 0.5} for s in range(1, 7)]
    metrics += [{"time": 7.0 + s, "step": s, "step_time": 0.5} for s in (5, 6)]  # redone after the event
    events = [
        {"event": EventKind.START, "rank": 0, "step": 0, "time": 0.0},
        {"event": event, "rank": 0, "step": 4, "time": 6.5},
    ]
    out = step_intervals([JobStreams(0, events, metrics)])
    recomputed = {
        m["step"]
        for m, (cat, b, e) in zip([m for m in metrics for _ in range(3)], out)
        if cat == "recomputation" and e > b and m["time"] < 6.5
    }
    assert recomputed == redone
