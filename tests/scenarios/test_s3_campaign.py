"""A campaign whose checkpoints live on a real S3 server (SeaweedFS on 127.0.0.1, signatures
checked), with credentials from the standard AWS environment, never from the spec."""

from __future__ import annotations

import os
import signal
import uuid

import pytest
from mlflow.tracking import MlflowClient

from flows.campaign import pretrain_campaign
from pretrain.checkpoints.info import describe
from pretrain.checkpoints.registry import TAG_CHECKPOINT
from pretrain.run.jobs import checkpoint_store
from pretrain.views.status import campaign_status
from support import s3_servers
from support.campaigns import (
    DATA,
    assert_no_duplicate_metric_steps,
    run_campaign_while,
    seed_data,
    small_spec,
    wait_for,
    worker_processes,
)
from support.s3_servers import BUCKET, SECRET_KEY
from trainer.storage import open_storage

seaweed = s3_servers.seaweed
aws_env = s3_servers.aws_env


def s3_spec(tmp_path, prepared_data, endpoint, **overrides):
    spec = small_spec(
        tmp_path,
        checkpoint={
            "interval": 4,
            "memory_interval": 2,
            "keep": 2,
            "uri": f"s3://{BUCKET}/campaigns/{uuid.uuid4().hex[:8]}",
            "s3_endpoint_url": endpoint,
        },
        **overrides,
    )
    seed_data(spec, prepared_data)
    return spec


def test_campaign_with_data_and_checkpoints_on_s3_trains_from_a_fresh_node_cache(
    prefect_harness, prepared_data, tmp_path, seaweed, aws_env
):
    data_uri = f"s3://{BUCKET}/datasets/{uuid.uuid4().hex[:8]}"
    spec = small_spec(
        tmp_path,
        data={**DATA, "uri": data_uri},
        tracking={"register_model": True},
        checkpoint={
            "interval": 4,
            "memory_interval": 2,
            "keep": 2,
            "s3_endpoint_url": seaweed.endpoint,
            "uri": f"s3://{BUCKET}/campaigns/{uuid.uuid4().hex[:8]}",
        },
    )
    data_set = open_storage(f"{data_uri}/{prepared_data.name}", endpoint_url=seaweed.endpoint)
    for f in sorted(prepared_data.iterdir(), key=lambda f: f.name == "manifest.json"):  # manifest last
        data_set.put_file(f.name, f)
    status = pretrain_campaign(spec=spec)
    assert_no_duplicate_metric_steps(spec.tracking_uri)
    assert status["status"] == "completed"
    registered = MlflowClient(spec.tracking_uri, spec.tracking_uri).get_model_version_by_alias(spec.name, "latest-good")
    assert registered.tags[TAG_CHECKPOINT] == checkpoint_store(spec, "main").ref(spec.stages[-1].steps).location
    for stage, s in zip(spec.stages, status["stages"]):
        store = checkpoint_store(spec, stage.name)
        assert store.location.startswith("s3://") and store.committed_steps()[0] == stage.steps
        assert s["good_checkpoint"]["path"] == f"{store.location}/step_{stage.steps:08d}"
        assert store.verdict(stage.steps)["verdict"] == "good" and store.read_pointer("good") == stage.steps
        assert not (spec.workdir_path / "checkpoints").exists()
    main_start = [r for r in status["stages"][1]["resumes"] if r["source"] == "init_from"]
    assert main_start[0]["checkpoint"].startswith("s3://")  # stage hand-off read from S3
    written = [spec.workdir_path / "ledger.json", *spec.workdir_path.glob("jobs/*/*/job.json")]
    assert all(SECRET_KEY not in p.read_text() for p in written)  # credentials stay in the environment
    # the data set stayed on S3 (preparation found it up to date); the workers read it from the node cache
    assert status["data"]["location"] == f"{data_uri}/{prepared_data.name}"
    assert not (spec.workdir_path / "data" / prepared_data.name).exists()
    cache = spec.workdir_path / "cache" / "data" / prepared_data.name
    assert {f.name: f.read_bytes() for f in cache.iterdir() if not f.name.startswith(".")} == {
        f.name: f.read_bytes() for f in prepared_data.iterdir()
    }
    meta = checkpoint_store(spec, "main").manifest(spec.stages[-1].steps).meta
    assert meta["data_dir"] == status["data"]["location"] and meta["data_fingerprint"] == prepared_data.name
    # `pretrain eval` / `export` elsewhere: the data set the checkpoint records, its val split fetched into their cache
    info = describe(
        status["stages"][-1]["good_checkpoint"]["path"],
        options={"endpoint_url": seaweed.endpoint},
        cache_dir=tmp_path / "elsewhere",
    )
    assert info.data_dir == tmp_path / "elsewhere" / prepared_data.name
    assert sorted(f.name for f in info.data_dir.glob("*.bin")) == sorted(
        s["file"] for s in info.data_manifest()["splits"]["val"]
    )


@pytest.mark.slow  # S3 checkpoints: the fresh-node-cache campaign above; a relaunch: test_resume
def test_worker_killed_with_s3_checkpoints_resumes(prefect_harness, prepared_data, tmp_path, seaweed, aws_env):
    spec = s3_spec(
        tmp_path,
        prepared_data,
        seaweed.endpoint,
        model={"n_layer": 4, "n_head": 4, "d_model": 128, "max_seq_len": 64},
        stages=[{"name": "main", "steps": 40, "seq_len": 64, "micro_batch": 8, "warmup_steps": 5}],
        fault_tolerance={"fast_recovery_timeout_s": 0},
    )  # the workers restart and restore from memory
    store = checkpoint_store(spec, "main")

    def kill_a_worker() -> None:
        wait_for(store.read_pointer, 120, "the first checkpoint on S3")
        victim = wait_for(lambda: worker_processes(spec.workdir_path), 30, "a worker")[-1]
        os.kill(victim.pid, signal.SIGKILL)

    status, _ = run_campaign_while(spec, kill_a_worker)
    assert_no_duplicate_metric_steps(spec.tracking_uri)
    stage = status["stages"][0]
    assert status["status"] == "completed" and stage["steps_done"] == 40
    assert any(r["restart_count"] > 0 and r["source"] == "memory" for r in stage["resumes"])
    assert all(store.verify(s) == [] for s in store.committed_steps())
    assert campaign_status(spec.workdir_path)["stages"][0]["latest_checkpoint"]["path"].startswith("s3://")


def test_block_credentials_reach_the_training_processes_and_nothing_else(
    prefect_harness, prepared_data, tmp_path, seaweed, monkeypatch
):
    """A campaign whose S3 credentials (and MLflow token) come from saved blocks, with no AWS
    variables anywhere: the training job's savers and the gate (child processes, env=) and the
    flow's own S3 reads (arguments) all authenticate against SeaweedFS, which checks signatures;
    this process's environment is the same afterwards, so a later campaign run by the same
    process (deployments.serve, a test session) never sees them."""
    from prefect_aws import MinIOCredentials
    from prefect_aws.client_parameters import AwsClientParameters

    from blocks import MlflowTracking, S3CampaignStorage
    from blocks.references import resolve_campaign
    from pretrain.spec.campaign import parse_spec

    for var in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_DEFAULT_REGION",
        "AWS_PROFILE",
        "MLFLOW_TRACKING_TOKEN",
    ):
        monkeypatch.delenv(var, raising=False)
    names = {k: f"{k}-{uuid.uuid4().hex[:8]}" for k in ("storage", "tracking")}
    S3CampaignStorage(
        bucket_name=BUCKET,
        prefix=f"blocks-{uuid.uuid4().hex[:6]}",
        root=tmp_path / "root",
        credentials=MinIOCredentials(
            minio_root_user=s3_servers.ACCESS_KEY,
            minio_root_password=SECRET_KEY,
            region_name="us-east-1",
            aws_client_parameters=AwsClientParameters(endpoint_url=seaweed.endpoint),
        ),
    ).save(names["storage"])
    token = "tok-" + uuid.uuid4().hex
    MlflowTracking(token=token).save(names["tracking"])
    wd = tmp_path / "wd"
    body = small_spec(wd).model_dump(mode="json", exclude={"workdir"})
    spec = parse_spec(
        {
            **body,
            "blocks": {
                "storage": f"s3-campaign-storage/{names['storage']}",
                "tracking": f"mlflow-tracking/{names['tracking']}",
            },
        }
    )
    seed_data(resolve_campaign(spec, None, str(wd)), prepared_data)
    before = dict(os.environ)

    status = pretrain_campaign(spec=spec, workdir=str(wd))

    assert status["status"] == "completed"
    assert all(s["good_checkpoint"]["path"].startswith(f"s3://{BUCKET}/") for s in status["stages"])
    changed = {k for k in set(os.environ) | set(before) if os.environ.get(k) != before.get(k)}
    assert not changed - {"_MLFLOW_TELEMETRY_SESSION_ID"}, changed  # MLflow's own; no AWS_*, no token left behind
    assert not [k for k, v in os.environ.items() if SECRET_KEY in v or token in v]
    written = [wd / "ledger.json", *wd.glob("jobs/*/*/job.json"), *wd.glob("jobs/*/*/*.log")]
    assert all(SECRET_KEY not in p.read_text() and token not in p.read_text() for p in written)
    # the next campaign this process runs resolves without the first one's credentials
    other = resolve_campaign(parse_spec({"name": "other", "workdir": str(tmp_path / "other")}))
    assert not other.credentials and "AWS_SECRET_ACCESS_KEY" not in other.credentials.child_env()
