"""Telemetry never stops training: the metrics forwarder survives an MLflow outage (a real
``mlflow server`` stopped and started again) and damaged lines in the job's files, and every
step still reaches MLflow exactly once."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, RESOURCE_DOES_NOT_EXIST, TEMPORARILY_UNAVAILABLE
from mlflow.tracking import MlflowClient
from prefect import flow

from pretrain.state.ledger import Ledger
from pretrain.tracking.metrics import MetricsForwarder
from pretrain.tracking.runs import TAG_WORKDIR, Tracker, describe_error, transient
from support.campaigns import assert_no_duplicate_metric_steps, small_spec, wait_for
from support.mlflow_server import MlflowServer
from tasks.checkpoints import record_verdict
from tasks.evaluation import log_evaluation
from tasks.mlflow_sync import sync_stage_end
from trainer.common.backoff import Backoff
from trainer.job.reporting import JsonLines, read_all, read_new_lines

LINE = b'{"step": 1, "time": 1.0}\n'


@pytest.mark.parametrize(
    "content, final, steps, damaged, consumed",
    [
        (LINE, False, [1], 0, len(LINE)),
        (LINE + b'{"step": 2, "ti', False, [1], 0, len(LINE)),  # the last line is being written: wait for it
        (LINE + b'{"step": 2, "ti', True, [1], 1, None),  # ... unless its writer is gone: damaged
        (LINE + b'{"step": 2, "time": 2.0}', True, [1, 2], 0, None),  # complete but for the newline
        (b'{"loss": 2.1, "st' + LINE, False, [], 1, None),  # a killed writer's fragment + the next writer's line
        (b"\x00" * 40 + b"\n" + LINE, False, [1], 1, None),  # disk-full zeros
        (b'[1, 2]\n"text"\n' + LINE, False, [1], 2, None),  # JSON, but not a record
        (b"\xff\xfe\n" + LINE, False, [1], 1, None),  # not UTF-8
        (b"\n  \n" + LINE, False, [1], 0, None),  # blank lines are no damage
    ],
)
def test_damaged_lines_are_skipped_and_counted_a_partial_last_line_waits(
    tmp_path, content, final, steps, damaged, consumed
):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(LINE + content)
    new = read_new_lines(path, len(LINE), final)  # from an offset, as a tailing reader reads
    assert [r["step"] for r in new.records] == steps and new.damaged == damaged
    assert new.offset == len(LINE) + (len(content) if consumed is None else consumed)
    if not final:
        assert read_all(path) == [json.loads(LINE)] + new.records  # the job's summary reads past damage too


def records(path, steps, stage_time=1000.0):
    out = JsonLines(path)
    for s in steps:
        out.write(
            {
                "step": s,
                "loss": 10.0 - s / 10,
                "lr": 0.001,
                "grad_norm": 1.0,
                "step_time": 0.1,
                "tokens_per_s": 100.0,
                "time": stage_time + s,
            }
        )
    out.close()


def history(client, run_id, key="loss"):
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def runs(tracker, stage="main"):
    parent = tracker.campaign_run("c1", "t", "hash", {})
    return parent, tracker.stage_run("c1", parent, "t", stage, {})


def test_a_moved_campaign_s_run_is_found_again_and_says_where_it_ran_last(tmp_path, own_tracking_store):
    tracker = Tracker(own_tracking_store, "e", tmp_path / "artifacts")
    first = tracker.campaign_run("c1", "t", "hash", {"lr": 0.1}, workdir=tmp_path / "old")
    again = tracker.campaign_run("c1", "t", "hash", {"lr": 0.1}, workdir=tmp_path / "new")
    assert again == first
    run = tracker.client.get_run(first)
    assert run.data.tags[TAG_WORKDIR] == str(tmp_path / "new") and run.data.params == {"lr": "0.1"}


def test_running_a_copy_of_a_workdir_that_still_holds_its_campaign_says_so_a_move_does_not(
    tmp_path, own_tracking_store
):
    from tasks.tracking import copy_warning

    original, copy = tmp_path / "a", tmp_path / "b"
    ledger = Ledger.open(small_spec(original))
    ledger.save()
    cid, tracker = ledger.record.campaign_id, Tracker(own_tracking_store, "e", tmp_path / "artifacts")
    assert copy_warning(tracker, cid, original) is None  # no run yet
    tracker.campaign_run(cid, "t", "hash", {}, workdir=original)
    assert copy_warning(tracker, cid, original) is None
    shutil.copytree(original, copy)
    assert f"{copy} and {original} hold the same campaign" in copy_warning(tracker, cid, copy)
    shutil.rmtree(original)  # so it was a move
    assert copy_warning(tracker, cid, copy) is None


def test_damaged_lines_are_skipped_and_a_line_being_written_is_forwarded_once_complete(tmp_path, own_tracking_store):
    uri = own_tracking_store
    tracker = Tracker(uri, "e", tmp_path / "artifacts")
    parent, stage = runs(tracker)
    metrics, events = tmp_path / "metrics.jsonl", tmp_path / "events.jsonl"
    logged: list[str] = []
    fwd = MetricsForwarder(tracker, metrics, stage, parent, 100, events_path=events, log=logged.append)
    records(metrics, [1, 2])
    with open(metrics, "ab") as f:  # a worker killed mid-line; its restarted successor appends step 3
        f.write(b'{"grad_norm": 1.0, "loss": 9.7, "st')
    records(metrics, [3])
    with open(metrics, "ab") as f:  # step 4 is being written
        f.write(b'{"loss": 9.6, "lr": 0.001, "st')
    ev = JsonLines(events)
    ev.write({"event": "checkpoint", "step": 2, "path": "/ckpt/step_00000002"})
    with open(events, "ab") as f:
        f.write(b"\x00" * 30 + b"\n")  # disk-full zeros
    ev.write({"event": "checkpoint", "step": "two", "path": 3})  # a record of the wrong shape
    ev.close()

    assert fwd.pump() == 2
    assert fwd.damaged == 3 and any(str(metrics) in m and "1 damaged line" in m for m in logged)
    with open(metrics, "ab") as f:
        f.write(b'ep": 4, "time": 1004.0}\n')
    assert fwd.pump() == 1 and fwd.damaged == 3

    client = MlflowClient(uri)
    assert history(client, stage) == [1, 2, 4] and history(client, parent) == [101, 102, 104]
    assert client.get_run(stage).data.tags["checkpoint.latest"] == "/ckpt/step_00000002"
    assert_no_duplicate_metric_steps(uri)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory, migrated_tracking_store):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server")).start(template=migrated_tracking_store)
    yield server
    server.stop()


def quick_forwarder(tracker, path, run_id, parent_id, offset, logged: list[str], **kw) -> MetricsForwarder:
    """A forwarder whose retries come quickly (0.2 s, then up to 1 s) and whose words go to ``logged``."""
    return MetricsForwarder(
        tracker, path, run_id, parent_id, offset, log=logged.append, backoff=Backoff(initial_s=0.2, max_s=1.0), **kw
    )


def good_verdict(step: int) -> dict:
    """The gate's verdict on the checkpoint of ``step``: good."""
    return {
        "step": step,
        "path": f"/ckpt/step_{step:08d}",
        "verdict": "good",
        "problems": [],
        "probe": {},
        "metrics": {"val_perplexity": 30.0},
        "time": 1.0,
    }


def test_an_mlflow_outage_never_raises_and_every_step_arrives_once_after_it(
    mlflow_server, prefect_harness, tmp_path, monkeypatch
):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail fast: the forwarder's own retries are tested
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    tracker = Tracker(mlflow_server.uri, "outage", tmp_path / "artifacts")
    parent, stage = runs(tracker)
    later_stage = tracker.stage_run("c1", parent, "t", "later", {})
    metrics, events = tmp_path / "metrics.jsonl", tmp_path / "events.jsonl"
    logged: list[str] = []
    fwd = quick_forwarder(tracker, metrics, stage, parent, 100, logged, events_path=events)
    records(metrics, [1, 2, 3])
    assert fwd.pump() == 3
    spec = small_spec(tmp_path / "wd", tracking={"uri": mlflow_server.uri, "register_model": False})
    Ledger.open(spec).set_stage_run("warmup", stage)
    verdict = good_verdict(4)

    mlflow_server.stop()
    wait_for(mlflow_server.down, 30, "the MLflow server to stop")
    records(metrics, [4, 5])
    JsonLines(events).write({"event": "checkpoint", "step": 4, "path": "/ckpt/step_00000004"})
    assert fwd.pump() == 0  # raises nothing: the steps wait
    assert len(fwd.pending) == 2 and fwd.last_step == 5
    assert len(logged) == 1 and "MLflow tracking failed" in logged[0] and "next try in" in logged[0]
    assert "\n" not in logged[0] and "Traceback" not in logged[0]
    # a job that starts while MLflow is away: its forwarder starts too (it asks MLflow later)
    other_tracker = Tracker(mlflow_server.uri, "outage", tmp_path / "artifacts")
    other = quick_forwarder(other_tracker, tmp_path / "other.jsonl", later_stage, parent, 200, logged)
    records(tmp_path / "other.jsonl", [1])
    assert other.pump() == 0
    records(metrics, [6, 7])  # training goes on meanwhile
    # a Prefect task that talks to MLflow (the evaluation of a checkpoint) waits the outage out
    # (its retry delays shortened here; the retry condition is the task's own)
    evaluation = ThreadPoolExecutor(1).submit(
        log_evaluation.with_options(retries=200, retry_delay_seconds=0.5),
        mlflow_server.uri,
        stage,
        {"val_loss": 3.5},
        7,
    )
    wait_for(lambda: fwd.backoff.due(), 5, "the next try")
    assert fwd.pump() == 0 and fwd.backoff.failures == 2
    # the gate judges a checkpoint meanwhile: its verdict stands (ledger) and the stage goes on
    in_flow(record_verdict, spec, 0, verdict)
    assert [v.step for v in Ledger.open(spec).stage("warmup").verdicts] == [4]

    mlflow_server.start()
    evaluation.result(timeout=120)
    assert fwd.drain(timeout_s=60)
    assert other.drain(timeout_s=60)
    assert any("works again" in m for m in logged)
    sync_stage_end(spec, Ledger.open(spec), 0)  # the stage's end sends what the outage kept from MLflow
    sync_stage_end(spec, Ledger.open(spec), 0)  # twice: still one value per step

    client = MlflowClient(mlflow_server.uri)
    assert history(client, stage) == [1, 2, 3, 4, 5, 6, 7]
    assert history(client, stage, "grad_norm") == [1, 2, 3, 4, 5, 6, 7]
    assert history(client, parent) == [101, 102, 103, 104, 105, 106, 107, 201]
    assert history(client, later_stage) == [1] and history(client, stage, "val_loss") == [7]
    assert client.get_run(stage).data.tags["checkpoint.latest"] == "/ckpt/step_00000004"
    assert client.get_run(stage).data.tags["verdict.00000004"] == "good"
    assert history(client, stage, "val_perplexity") == [4]
    assert_no_duplicate_metric_steps(mlflow_server.uri)


@flow
def in_flow(fn, *args):
    """Run a task body in a flow run (as the stage flow does)."""
    return fn(*args)


def test_drain_gives_up_after_its_timeout_and_says_where_the_steps_are(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    from support.s3_servers import free_ports

    nowhere = f"http://127.0.0.1:{free_ports(1)[0]}"  # nothing listens: MLflow is away for good
    logged: list[str] = []
    metrics = tmp_path / "metrics.jsonl"
    records(metrics, [1, 2])
    fwd = MetricsForwarder(
        Tracker(nowhere, "e", tmp_path / "artifacts"),
        metrics,
        "run-a",
        "run-b",
        0,
        log=logged.append,
        backoff=Backoff(initial_s=0.1, max_s=0.2),
    )
    assert fwd.drain(timeout_s=1.0) is False
    assert "2 step(s) not sent" in logged[-1] and str(metrics) in logged[-1]


@pytest.mark.parametrize(
    "err, shown, hidden",
    [
        (
            MlflowException(
                "API request to https://alice:s3cret@mlflow.example/api/2.0/x failed with exception boom\nmore"
            ),
            "MlflowException: API request to https://***@mlflow.example/api/2.0/x failed with exception boom",
            "s3cret",
        ),
        (
            ConnectionRefusedError(111, "Connection refused"),
            "ConnectionRefusedError: [Errno 111] Connection refused",
            "\n",
        ),
        (MlflowException("x" * 1000), "MlflowException: " + "x" * 300 + "…", "x" * 301),
    ],
)
def test_a_tracking_error_is_one_line_without_credentials(err, shown, hidden):
    assert describe_error(err) == shown and hidden not in describe_error(err)


@pytest.mark.parametrize(
    "err, retry",
    [
        (
            MlflowException("API request to http://h/api failed with exception Max retries exceeded"),
            True,
        ),  # unreachable
        (MlflowException("busy", error_code=TEMPORARILY_UNAVAILABLE), True),
        (ConnectionResetError(104, "Connection reset by peer"), True),
        (OSError(28, "No space left on device"), True),
        (
            MlflowException("Run 'x' not found", error_code=RESOURCE_DOES_NOT_EXIST),
            False,
        ),  # a refusal: retrying changes nothing
        (MlflowException("bad value", error_code=INVALID_PARAMETER_VALUE), False),
        (KeyError("val_loss"), False),  # a bug, not an outage
    ],
)
def test_tasks_retry_what_mlflow_may_get_over_and_nothing_else(err, retry):
    assert transient(err) is retry
