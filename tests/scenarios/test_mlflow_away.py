"""MLflow away when a campaign starts never holds training: the campaign trains without its
runs (one warning, no minutes of MLflow's own retries), and once MLflow answers the runs are
opened and hold every step once, with what they missed (data set input, node check)."""

from __future__ import annotations

import io
import logging
import re
import socket

import pytest
from mlflow.tracking import MlflowClient
from rich.console import Console
from test_tracking import history, records

from pretrain.state.ledger import Ledger
from pretrain.tracking.metrics import MetricsForwarder
from pretrain.tracking.runs import METRIC_KEYS, Tracker
from pretrain.views.status import campaign_status, render
from support.campaigns import assert_no_duplicate_metric_steps, seed_data, small_spec, wait_for
from support.mlflow_server import MlflowServer
from support.s3_servers import free_ports
from trainer.common.backoff import Backoff


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def warnings_of_runs():
    """The warnings the flow and task runs log (what a user reads in the console and the UI)."""
    handler = Lines()
    loggers = [logging.getLogger(n) for n in ("prefect.flow_runs", "prefect.task_runs")]
    for lg in loggers:
        lg.addHandler(handler)
    yield handler.lines
    for lg in loggers:
        lg.removeHandler(handler)


@pytest.mark.parametrize(
    "uri, away",
    [
        ("sqlite:///{tmp}/nowhere/mlflow.db", None),  # a local store is not asked (its errors are real ones)
        ("http://127.0.0.1:{port}", "connection refused"),  # nothing listens there
    ],
)
def test_only_a_server_is_asked_whether_it_answers(uri, away, tmp_path):
    assert Tracker(uri.format(tmp=tmp_path, port=free_ports(1)[0]), "e", tmp_path).away() == away


def test_a_forwarder_without_runs_opens_them_once_mlflow_answers(tmp_path, migrated_tracking_store):
    server = MlflowServer(tmp_path / "mlflow")  # not started yet: away
    tracker, opened, logged = Tracker(server.uri, "late", tmp_path / "artifacts"), [], []

    def open_runs():
        parent = tracker.campaign_run("c1", "t", "h", {})
        opened.append(parent)
        return parent, tracker.stage_run("c1", parent, "t", "warmup", {})

    metrics = tmp_path / "metrics.jsonl"
    fwd = MetricsForwarder(
        tracker,
        metrics,
        None,
        None,
        100,
        log=logged.append,
        backoff=Backoff(initial_s=0.05, max_s=0.1),
        open_runs=open_runs,
    )
    records(metrics, [1, 2])
    assert fwd.pump() == 0 and not opened  # nothing raised, nothing opened: the steps wait
    assert len(logged) == 1 and "does not answer (connection refused)" in logged[0] and "training goes on" in logged[0]
    server.start(template=migrated_tracking_store)
    try:
        records(metrics, [3])
        wait_for(fwd.backoff.due, 5, "the next try")
        assert fwd.pump() == 3 and len(opened) == 1
        assert fwd.drain(timeout_s=10)
        client = MlflowClient(server.uri)
        assert history(client, fwd.stage_run_id) == [1, 2, 3] and history(client, fwd.parent_run_id) == [101, 102, 103]
    finally:
        server.stop()


def test_a_campaign_completes_while_mlflow_is_away_and_its_next_run_catches_mlflow_up(
    prefect_harness, prepared_data, tmp_path, migrated_tracking_store, warnings_of_runs
):
    from flows.campaign import pretrain_campaign

    server = MlflowServer(tmp_path / "mlflow")  # away for the whole first run
    spec = small_spec(tmp_path / "wd", tracking={"uri": server.uri, "experiment": "away", "registration_wait_s": 0})
    seed_data(spec, prepared_data)
    status = pretrain_campaign(spec=spec)
    assert status["status"] == "completed", status  # nothing waited on MLflow, nothing failed for it
    assert [s["steps_done"] for s in status["stages"]] == [6, 10]
    record = Ledger.open(spec).record
    assert record.mlflow.behind and record.mlflow.parent_run_id is None
    # the final model could not be registered: the campaign completed with the registration pending
    assert record.registered_model is None and "MLflow did not answer within 0 s" in record.registration_pending
    assert any(
        "the final model is not registered yet" in w and "run it again once MLflow answers" in w
        for w in warnings_of_runs
    )
    away = [w for w in warnings_of_runs if "does not answer" in w]
    assert away and "training goes on" in away[0] and not any("Traceback" in w for w in warnings_of_runs)
    assert sum("training goes on:" in w for w in warnings_of_runs) == 1  # told once, not at every stage and sync
    console = Console(record=True, width=200, file=io.StringIO())
    render(campaign_status(spec.workdir_path), console)  # what `pretrain status` prints
    text = console.export_text()
    assert "MLflow is behind the campaign (it was away)" in text
    assert "Model: not registered yet — MLflow did not answer" in text

    server.start(template=migrated_tracking_store)
    try:
        assert pretrain_campaign(spec=spec)["status"] == "completed"  # its next run: MLflow catches up
        record = Ledger.open(spec).record
        assert not record.mlflow.behind
        # ... and the model is registered from the final good checkpoint, the pending note gone
        assert record.registration_pending is None and record.registered_model["name"] == spec.registered_model_name
        version = MlflowClient(server.uri).get_model_version_by_alias(spec.registered_model_name, "latest-good")
        assert version.run_id == record.mlflow.parent_run_id
        assert record.registered_model["checkpoint"] == record.stages["main"].good_checkpoint.path
        client = MlflowClient(server.uri)
        parent = client.get_run(record.mlflow.parent_run_id)
        stages = [client.get_run(record.stages[s].mlflow_run_id) for s in ("warmup", "main")]
        assert [r.info.status for r in [parent, *stages]] == ["FINISHED"] * 3
        assert {r.data.tags["mlflow.parentRunId"] for r in stages} == {parent.info.run_id}
        assert history(client, stages[0].info.run_id) == list(range(1, 7))  # every step, once
        assert history(client, stages[1].info.run_id) == list(range(1, 11))
        assert history(client, parent.info.run_id) == list(range(1, 17))  # campaign steps
        assert [d.dataset.name for d in parent.inputs.dataset_inputs] == ["t-data"]  # what it missed at the start
        assert "node_check.json" in [a.path for a in client.list_artifacts(parent.info.run_id)]
        assert_no_duplicate_metric_steps(server.uri)
        # the same as a campaign that had MLflow all along: every metric at the same steps, the same tags
        along = small_spec(
            tmp_path / "along", tracking={"uri": server.uri, "register_model": False, "experiment": "along"}
        )
        seed_data(along, prepared_data)
        assert pretrain_campaign(spec=along)["status"] == "completed"
        assert seen(client, Ledger.open(along).record) == seen(client, record)
    finally:
        server.stop()


def seen(client: MlflowClient, record) -> list[dict]:
    """What the campaign's runs show, less what differs between any two campaigns (which steps
    checkpoints were saved at: a saver busy with one skips a snapshot): for each run (the
    campaign's, then each stage's) its status, its tag and metric names, the steps of its training
    metrics and the last step of each evaluation metric."""
    out = []
    for run_id in [record.mlflow.parent_run_id] + [record.stages[s].mlflow_run_id for s in ("warmup", "main")]:
        run = client.get_run(run_id)
        out.append(
            {
                "status": run.info.status,
                "metrics": sorted(run.data.metrics),
                "tags": sorted({re.sub(r"\d{8}", "N", k) for k in run.data.tags if not k.startswith("mlflow.")}),
                **{
                    k: history(client, run_id, k)
                    for k in METRIC_KEYS
                    if k in run.data.metrics and k != "checkpoint_block_s"
                },
                **{k: history(client, run_id, k)[-1] for k in run.data.metrics if k.startswith("val_")},
            }
        )
    return out


def test_a_run_ending_while_mlflow_is_away_is_recorded_without_waiting_on_it(tmp_path):
    from pretrain.run.outcome import close_campaign

    spec = small_spec(tmp_path / "wd", tracking={"uri": f"http://127.0.0.1:{free_ports(1)[0]}"})
    ledger = Ledger.open(spec)
    ledger.set_parent_run("run-of-the-campaign")
    ledger.begin_run("flow-run-1", spec)
    record = close_campaign(spec, "failed", "a worker crashed", "flow-run-1")
    assert record.status == "failed" and record.end.cause == "a worker crashed"
    assert Ledger.open(spec).record.mlflow.behind  # the runs' end is MLflow's to catch up with


def test_the_job_loop_never_waits_on_an_mlflow_that_hangs(tmp_path, monkeypatch):
    """A server that takes connections and never answers: MLflow's client would wait minutes
    (a 120 s timeout, 7 retries) — in the forwarder's own thread, not in the job's loop."""
    from pretrain.tracking.forwarder import ForwarderThread

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the thread left behind ends soon after the test
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    with socket.create_server(("127.0.0.1", 0)) as hole:  # listens, never accepts: every request hangs
        logged: list[str] = []
        metrics = tmp_path / "metrics.jsonl"
        records(metrics, [1, 2])
        fwd = MetricsForwarder(
            Tracker(f"http://127.0.0.1:{hole.getsockname()[1]}", "e", tmp_path),
            metrics,
            "run-a",
            "run-b",
            0,
            log=logged.append,
            backoff=Backoff(initial_s=0.1, max_s=0.2),
        )
        forwarding = ForwarderThread(fwd, poll_s=0.05, drain_s=0.2, margin_s=0.5).start()
        wait_for(lambda: fwd.offset > 0, 30, "the forwarder to read the steps and ask MLflow")
        assert forwarding.finish() is False  # the caller goes on; the request still hangs in the thread
        assert "MLflow is away (timed out)" in logged[-1] and str(metrics) in logged[-1]
