"""The Prefect-native surface end to end on a real ``prefect server start``: ``prefect deploy --all``,
a process worker running campaigns from the deployment, artifacts and events through the API,
the evaluation trigger, one campaign at a time, cancelling from the API (as the UI does), and a
deployment whose runs clone the code from git."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, DeploymentFilter, DeploymentFilterName
from prefect.client.schemas.sorting import ArtifactSort
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectAlreadyExists
from prefect.states import Cancelled, Cancelling
from prefect_kubernetes.worker import KubernetesWorker

from pretrain.run.outcome import TAG_END_CAUSE
from pretrain.spec.campaign import parse_spec
from pretrain.state.ledger import Ledger
from pretrain.state.lock import CampaignBusy
from support.campaigns import (
    DATA,
    assert_no_duplicate_metric_steps,
    campaign_data_dir,
    campaign_events,
    campaign_processes,
    seed_data,
    wait_for,
)
from tasks.artifacts import artifact_key
from trainer.checkpoint import store as ckpt
from trainer.job.reporting import read_all

ROOT = Path(__file__).resolve().parents[2]
TRAINER = ("trainer.launch", "trainer.worker", "trainer.saver", "trainer.nodecheck")


def spec_file(tmp_path: Path, prepared_data: Path, name: str, **overrides) -> tuple[Path, object]:
    """A one-node, one-worker campaign in its own workdir with the session's data seeded."""
    body = {
        "name": name,
        "workdir": str(tmp_path / name),
        "data": DATA,
        "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "max_seq_len": 32},
        "cluster": {"workers_per_node": 1, "max_restarts": 0},
        "stages": [{"name": "main", "steps": 8, "seq_len": 32, "micro_batch": 4, "warmup_steps": 2}],
        "checkpoint": {"interval": 4, "memory_interval": 2, "keep": 3},
        "resume": {"max_attempts": 1},
    }
    body.update(overrides)
    spec = parse_spec(body)
    seed_data(spec, prepared_data)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path, spec


def final_state(flow_run_id, timeout: float):
    def done():
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(flow_run_id)
        return run if run.state and run.state.is_final() else None

    return wait_for(done, timeout, f"flow run {flow_run_id} to end", interval=1.0).state


def start(deployment: str, **parameters):
    return run_deployment(deployment, parameters=parameters, timeout=0, as_subflow=False)


def latest_artifact(kind: str, campaign: str):
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key(kind, campaign)])),
            sort=ArtifactSort.CREATED_DESC,
            limit=1,
        )
    return found[0] if found else None


def trainer_processes(workdir: Path) -> list:
    return [p for m in TRAINER for p in campaign_processes(workdir, m)]


@pytest.fixture(scope="module")
def deployed(prefect_server):
    """Work pools as the README creates them, and ``prefect deploy --all`` from the checkout."""
    with prefect_server.settings(), get_client(sync_client=True) as client:
        for pool in (
            WorkPoolCreate(name="local-process", type="process"),
            WorkPoolCreate(
                name="kubernetes", type="kubernetes", base_job_template=KubernetesWorker.get_default_base_job_template()
            ),
        ):
            try:
                client.create_work_pool(pool)
            except ObjectAlreadyExists:
                pass
    proc = prefect_server.prefect("--no-prompt", "deploy", "--all")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return prefect_server


@pytest.fixture(scope="module")
def worker(deployed, tmp_path_factory):
    """A process worker of the local pool (runs from the checkout)."""
    deployed.start_worker("local-process", tmp_path_factory.mktemp("worker") / "worker.log")
    return deployed


def test_prefect_deploy_all_creates_every_deployment(deployed):
    with deployed.settings(), get_client(sync_client=True) as client:
        campaign = client.read_deployment_by_name("pretrain-campaign/pretrain-campaign")
        evaluation = client.read_deployment_by_name("evaluate-checkpoint/evaluate-checkpoint")
        prepare = client.read_deployment_by_name("prepare-data/prepare-data")
        k8s = client.read_deployment_by_name("pretrain-campaign/kubernetes")
        nightly = client.read_deployment_by_name("pretrain-campaign/advance-campaign")
        automations = client.read_resource_related_automations(f"prefect.deployment.{evaluation.id}")
    assert campaign.global_concurrency_limit.limit == 1 and k8s.global_concurrency_limit.limit == 1
    assert [(s.schedule.cron, s.active) for s in campaign.schedules] == [("0 2 * * *", False)]
    assert (
        nightly.global_concurrency_limit.limit == 1 and nightly.concurrency_options.collision_strategy == "CANCEL_NEW"
    )
    assert nightly.parameters["run_for"] and [(s.schedule.cron, s.active) for s in nightly.schedules] == [
        ("0 1 * * *", False)
    ]
    for dep in (campaign, prepare, evaluation):
        assert dep.work_pool_name == "local-process"
        assert dep.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
    assert k8s.work_pool_name == "kubernetes" and k8s.job_variables["image"].startswith("ghcr.io/")
    assert "prefect.deployments.steps.git_clone" in k8s.pull_steps[0]
    [automation] = automations
    assert automation.enabled and automation.trigger.expect == {"pretrain.checkpoint.good"}
    assert automation.trigger.match.model_dump()["pretrain.checkpoint.final"] == "true"  # one per stage
    assert automation.actions[0].parameters["checkpoint"] == "{{ event.payload.checkpoint }}"  # rendered per event


def test_worker_runs_a_campaign_with_artifacts_events_and_trigger(worker, prepared_data, tmp_path):
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    path, spec = spec_file(tmp_path, prepared_data, name)
    with worker.settings():
        run = start("pretrain-campaign/pretrain-campaign", spec_path=str(path))
        state = final_state(run.id, 600)
        assert state.is_completed(), state.message
        good = f"{spec.workdir_path}/checkpoints/main/step_00000008"

        report = latest_artifact("campaign-report", name)
        assert report.type == "markdown" and f"# Campaign `{name}` — completed" in report.data
        assert "## Checkpoints" in report.data and "| main | 8 | good | True |" in report.data
        assert "## Node check" in report.data and "## Time lost per cause" in report.data
        table = latest_artifact("checkpoints", name)
        rows = json.loads(table.data)
        assert [(r["step"], r["verdict"]) for r in rows][-1] == (8, "good") and rows[-1]["eval_loss"] > 0
        progress = latest_artifact("training-progress", name)
        assert progress.type == "progress" and float(progress.data) == 100.0
        link = latest_artifact("mlflow-run", name)
        parent = Ledger.read(spec.layout).record.mlflow.parent_run_id
        assert link.type == "markdown" and parent in link.data
        assert latest_artifact("node-check", name).type == "table"

        seen = wait_for(
            lambda: (
                {e["event"] for e in campaign_events(worker.api_url, name)}
                >= {"pretrain.checkpoint.good", "pretrain.campaign.completed"}
                and campaign_events(worker.api_url, name)
            ),
            60,
            "the campaign's events",
        )
        # the gate judges every committed checkpoint (step 4 too, if it was persisted): one event each
        goods = [e for e in seen if e["event"] == "pretrain.checkpoint.good"]
        assert {e["payload"]["step"] for e in goods} <= {4, 8}
        [good_event] = [e for e in goods if e["payload"]["step"] == 8]
        assert good_event["payload"]["checkpoint"] == good and good_event["payload"]["final"]
        assert good_event["resource"]["prefect.resource.name"] == name
        assert {e["payload"]["step"]: e["resource"]["pretrain.checkpoint.final"] for e in goods} == {
            e["payload"]["step"]: str(e["payload"]["step"] == 8).lower() for e in goods
        }
        [done] = [e for e in seen if e["event"] == "pretrain.campaign.completed"]  # names the model it registered
        assert (done["payload"]["registered_model"], done["payload"]["registration_pending"]) == (
            f"models:/{name}@latest-good",
            None,
        )

        def evaluation_runs():  # of this campaign's checkpoints
            with get_client(sync_client=True) as client:
                runs = client.read_flow_runs(
                    deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["evaluate-checkpoint"]))
                )
            return [r for r in runs if r.parameters.get("checkpoint", "").startswith(str(spec.workdir_path))]

        [triggered] = wait_for(evaluation_runs, 60, "the trigger to start the evaluation deployment")
        assert triggered.parameters == {"checkpoint": good, "data_dir": str(campaign_data_dir(spec))}
        assert final_state(triggered.id, 300).is_completed()
        assert len(evaluation_runs()) == 1  # only the final checkpoint (its event came after step 4's, if any)
    parent_run = MlflowClient(spec.tracking_uri).get_run(parent)
    assert parent_run.info.status == "FINISHED"
    assert_no_duplicate_metric_steps(spec.tracking_uri)


@pytest.fixture(scope="module")
def training(worker, prepared_data, tmp_path_factory):
    """A campaign run by the worker that is busy training (a model slow enough to be caught in
    the act; periodic checkpoints never come, only the snapshots in memory)."""
    tmp = tmp_path_factory.mktemp("training")
    path, spec = spec_file(
        tmp,
        prepared_data,
        f"busy-{uuid.uuid4().hex[:6]}",
        model={"n_layer": 4, "n_head": 4, "d_model": 128, "max_seq_len": 64},
        stages=[{"name": "main", "steps": 2000, "seq_len": 64, "micro_batch": 8, "warmup_steps": 5}],
        checkpoint={"interval": 1000, "memory_interval": 2, "keep": 3},
    )
    metrics = spec.workdir_path / "jobs" / "main" / "attempt_000" / "metrics.jsonl"
    with worker.settings():
        run = start("pretrain-campaign/pretrain-campaign", spec_path=str(path))
    wait_for(lambda: any(r["step"] >= 6 for r in read_all(metrics)), 600, "the campaign to train 6 steps", interval=0.5)
    return run, path, spec


@pytest.mark.slow
def test_a_second_run_of_a_training_campaign_never_trains(training, worker):
    run, path, spec = training
    with worker.settings():
        # through the deployment: the concurrency limit holds it back
        queued = start("pretrain-campaign/pretrain-campaign", spec_path=str(path))

        def held():
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(queued.id).state
            return state.name == "AwaitingConcurrencySlot"

        wait_for(held, 60, "the queued run to wait for the concurrency slot", interval=1.0)
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(queued.id, Cancelled(message="test: queued duplicate"), force=True)

        # from anywhere else (another deployment, `pretrain run`, a notebook): the workdir lock refuses it
        from flows.campaign import pretrain_campaign

        started = time.monotonic()
        with pytest.raises(
            CampaignBusy,
            match=rf"campaign '{spec.name}' in .* is already running \(pid \d+ on .*, "
            rf"flow run {run.id}, since .*\).*wait for that run to finish, or cancel it",
        ):
            pretrain_campaign(spec_path=str(path))
        assert time.monotonic() - started < 60
    record = Ledger.read(spec.layout).record
    assert record.status == "running" and record.invocations == 1 and record.flow_run == str(run.id)
    assert len(campaign_processes(spec.workdir_path, "trainer.worker")) == 1  # still the first run's only worker


def test_cancelling_from_the_api_pauses_the_campaign_at_a_validated_checkpoint(training, worker):
    """The UI's cancel: the worker's SIGTERM pauses the campaign within the 30 s before its SIGKILL;
    the run ends Cancelled, the ledger says paused (cancelled from Prefect), the next run goes on."""
    run, _, spec = training
    with worker.settings():
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(run.id, Cancelling(message="test: cancel from the UI"), force=True)
        assert final_state(run.id, 180).is_cancelled()
        report = latest_artifact("campaign-report", spec.name).data
    wait_for(lambda: not trainer_processes(spec.workdir_path), 30, "every training process to exit")
    store = ckpt.CheckpointStore.open(spec.workdir_path / "checkpoints" / "main")
    [step] = store.committed_steps()  # periodic checkpoints are 1000 steps apart: this is the save at breakpoint
    assert step >= 6 and step % 2 == 0 and store.verify(step) == []
    assert f"# Campaign `{spec.name}` — paused" in report
    record = Ledger.read(spec.layout).record
    assert (record.status, record.stages["main"].status, record.end.step) == ("paused", "paused", step)
    assert record.end.cause == f"paused at main step {step}: cancelled from Prefect (SIGTERM from its worker)"
    assert record.stages["main"].newest_good_step() == step  # judged by the gate: the next run resumes there
    client = MlflowClient(spec.tracking_uri)
    for run_id in (record.mlflow.parent_run_id, record.stages["main"].mlflow_run_id):
        mlflow_run = client.get_run(run_id)
        assert mlflow_run.info.status == "SCHEDULED" and "cancelled from Prefect" in mlflow_run.data.tags[TAG_END_CAUSE]
    assert_no_duplicate_metric_steps(spec.tracking_uri)


def _git_snapshot(dest: Path) -> str:
    """This checkout's files (tracked and new, not ignored) committed to a fresh repository."""
    files = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
        )
        .stdout.decode()
        .split("\0")
    )
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.invalid"]
    for cmd in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "snapshot"]):
        subprocess.run(git + cmd, cwd=dest, check=True, capture_output=True)
    return dest.resolve().as_uri()


@pytest.mark.slow
def test_deploy_from_git_runs_the_cloned_code(worker, prepared_data, tmp_path):
    url = _git_snapshot(tmp_path / "repo")
    proc = subprocess.run(
        [sys.executable, "-m", "deployments.deploy", "--git", url, "--branch", "main"],
        cwd=ROOT,
        env=worker.env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    path, spec = spec_file(tmp_path, prepared_data, f"git-{uuid.uuid4().hex[:6]}")
    with worker.settings():
        with get_client(sync_client=True) as client:
            dep = client.read_deployment_by_name("prepare-data/prepare-data")
        assert dep.pull_steps[0]["prefect.deployments.steps.git_clone"]["repository"] == url
        run = start("prepare-data/prepare-data", spec_path=str(path))
        state = final_state(run.id, 300)
    assert state.is_completed(), state.message
    assert Ledger.read(spec.layout).record.data.vocab_size > 0
