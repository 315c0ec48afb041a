"""The Prefect blocks against a real ``prefect server start``: Prefect's standard block checks,
save/load round trips, secrets kept out of reprs and dumps, registration (CLI and the
``prefect.collections`` entry point), and campaign specs that refer to saved blocks by name."""

from __future__ import annotations

import os
import uuid

import pytest
from prefect.blocks.core import Block
from prefect.client.orchestration import get_client
from prefect.testing.standard_test_suites import BlockStandardTestSuite
from prefect_aws import AwsCredentials, MinIOCredentials
from prefect_aws.client_parameters import AwsClientParameters
from pydantic import ValidationError

import blocks
from blocks import KubernetesCluster, LocalCampaignStorage, LocalProcessCluster, MlflowTracking, S3CampaignStorage
from blocks.references import apply_blocks, resolve_campaign
from pretrain.run.jobs import checkpoint_store
from pretrain.spec.campaign import SpecError, parse_spec
from pretrain.spec.cluster import ClusterSpec
from pretrain.spec.kube import KubernetesSpec, SecretKeyRef
from pretrain.spec.tracking import TrackingSpec
from support import s3_servers

SECRET = "tok-" + uuid.uuid4().hex
SLUGS = {
    "local-campaign-storage",
    "s3-campaign-storage",
    "local-process-cluster",
    "kubernetes-training-cluster",
    "mlflow-tracking",
}
seaweed = s3_servers.seaweed


class _OfflineBlockSuite(BlockStandardTestSuite):
    def test_has_a_valid_image(self, block: type[Block]) -> None:
        # The upstream check downloads the logo; these machines have no network, and the logo is
        # optional. Check what can be checked offline.
        assert block._logo_url is None or str(block._logo_url).startswith("https://")


@pytest.mark.parametrize("cls", [getattr(blocks, n) for n in blocks.__all__], ids=blocks.__all__)
class TestStandard(_OfflineBlockSuite):
    @pytest.fixture
    def block(self, cls) -> type[Block]:
        return cls


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _minio(secret: str = SECRET, endpoint: str = "http://127.0.0.1:9000") -> MinIOCredentials:
    return MinIOCredentials(
        minio_root_user="ak",
        minio_root_password=secret,
        region_name="us-east-1",
        aws_client_parameters=AwsClientParameters(endpoint_url=endpoint),
    )


def test_package_exports_every_block():
    assert {getattr(blocks, n).get_block_type_slug() for n in blocks.__all__} == SLUGS


def test_server_knows_the_block_types_from_the_collection_entry_point(on_prefect_server):
    # `prefect server start` imports the `prefect.collections` entry points: the UI lists the
    # block types before anyone ran `prefect block register`
    with get_client(sync_client=True) as client:
        assert SLUGS <= {b.slug for b in client.read_block_types()}


def test_prefect_block_register_cli(on_prefect_server):
    proc = on_prefect_server.prefect("block", "register", "-m", "blocks", timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Successfully registered 5 blocks" in proc.stdout, proc.stdout


def test_local_storage_round_trip(on_prefect_server, tmp_path):
    name = _name("storage")
    LocalCampaignStorage(root=tmp_path / "campaigns").save(name)
    loaded = LocalCampaignStorage.load(name)
    assert loaded.workdir_for("tiny") == (tmp_path / "campaigns" / "tiny").resolve()
    assert loaded.spec_update("tiny") == {"workdir": str((tmp_path / "campaigns" / "tiny").resolve())}
    assert loaded.environment() == {}


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "../escape", "/abs"])
@pytest.mark.parametrize("cls", [LocalCampaignStorage, S3CampaignStorage])
def test_storage_rejects_names_that_leave_the_root(tmp_path, bad, cls):
    block = cls(root=tmp_path) if cls is LocalCampaignStorage else cls(bucket_name="b12", root=tmp_path)
    with pytest.raises(ValueError, match="single path component"):
        block.workdir_for(bad)


def test_s3_storage_round_trip_keeps_credentials_secret(on_prefect_server, tmp_path):
    name = _name("s3")
    S3CampaignStorage(bucket_name="ckpt", prefix="teams/a/", credentials=_minio(), root=tmp_path).save(name)
    loaded = S3CampaignStorage.load(name)
    assert isinstance(loaded.credentials, MinIOCredentials)
    assert loaded.spec_update("c1") == {
        "workdir": str(tmp_path.resolve() / "c1"),
        "checkpoint": {
            "uri": "s3://ckpt/teams/a/c1",
            "s3_endpoint_url": "http://127.0.0.1:9000",
            "s3_region": "us-east-1",
        },
    }
    assert loaded.environment() == {
        "AWS_ACCESS_KEY_ID": "ak",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    for text in (repr(loaded), str(loaded), loaded.model_dump_json(), str(loaded.spec_update("c1"))):
        assert SECRET not in text
    with get_client(sync_client=True) as client:
        doc = client.read_block_document_by_name(name, "s3-campaign-storage", include_secrets=False)
    assert SECRET not in str(doc.data)


def test_s3_storage_takes_aws_credentials_too(tmp_path):
    block = S3CampaignStorage(
        bucket_name="ckpt",
        credentials=AwsCredentials(
            aws_access_key_id="AKIA1", aws_secret_access_key=SECRET, aws_session_token="st", region_name="eu-west-1"
        ),
    )
    assert block.environment() == {
        "AWS_ACCESS_KEY_ID": "AKIA1",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_SESSION_TOKEN": "st",
        "AWS_DEFAULT_REGION": "eu-west-1",
    }
    assert block.spec_update("c")["checkpoint"] == {
        "uri": "s3://ckpt/campaigns/c",
        "s3_endpoint_url": None,
        "s3_region": "eu-west-1",
    }
    # a block that names no keys gives none: each process's boto3 finds its own (profile, role, IRSA)
    assert S3CampaignStorage(bucket_name="ckpt").environment() == {}
    assert S3CampaignStorage(bucket_name="ckpt", credentials=AwsCredentials(profile_name="train")).environment() == {
        "AWS_PROFILE": "train"
    }


@pytest.mark.parametrize(
    "make, field, where",
    [
        (
            lambda: MlflowTracking(tracking_uri=f"https://u:{SECRET}@mlflow.example.com"),
            "tracking_uri",
            "MLFLOW_TRACKING_USERNAME",
        ),
        (
            lambda: S3CampaignStorage(
                bucket_name="ckpt", credentials=_minio(endpoint=f"http://ak:{SECRET}@127.0.0.1:9000")
            ),
            "credentials",
            "AWS_ACCESS_KEY_ID",
        ),
        (
            lambda: S3CampaignStorage(
                bucket_name="ckpt", credentials=AwsCredentials(assume_role_arn="arn:aws:iam::1:role/r")
            ),
            "credentials",
            "profile",
        ),
    ],
)
def test_blocks_refuse_credentials_in_urls_and_frozen_roles(make, field, where):
    with pytest.raises(ValidationError) as err:
        make()
    assert field in str(err.value) and where in str(err.value) and SECRET not in str(err.value)


def test_cluster_blocks_mirror_cluster_spec():
    shared = set(ClusterSpec.model_fields) - {
        "kind",
        "kubernetes",
    }  # kind: the block's type; kubernetes: its own fields
    assert set(LocalProcessCluster.model_fields) == shared
    assert set(KubernetesCluster.model_fields) >= shared | set(KubernetesSpec.model_fields)
    assert LocalProcessCluster().to_spec() == ClusterSpec()


def test_cluster_round_trip(on_prefect_server):
    name = _name("cluster")
    values = dict(workers_per_node=4, nodes_min=1, nodes_max=2, max_restarts=5, backend="gloo", threads_per_worker=1)
    LocalProcessCluster(**values).save(name)
    assert LocalProcessCluster.load(name).to_spec() == ClusterSpec(kind="local", **values)


def test_cluster_rejects_what_the_spec_rejects():
    for cls, extra in ((LocalProcessCluster, {}), (KubernetesCluster, {"image": "img"})):
        with pytest.raises(ValidationError, match="nodes_min"):
            cls(nodes_min=3, nodes_max=2, **extra)
        with pytest.raises(ValidationError):
            cls(workers_per_node=0, **extra)


def test_kubernetes_cluster_block_is_the_spec_section_and_is_refused_without_an_api(on_prefect_server, monkeypatch):
    name = _name("k8s")
    KubernetesCluster(
        image="ghcr.io/o/p:1",
        namespace="train",
        nodes_max=4,
        gpus_per_node=8,
        node_selector={"gpu": "h100"},
        secret_env={"HF_TOKEN": {"secret": "hf", "key": "token"}},
    ).save(name)
    loaded = KubernetesCluster.load(name)
    assert (loaded.namespace, loaded.nodes_max, loaded.gpus_per_node, loaded.node_selector) == (
        "train",
        4,
        8,
        {"gpu": "h100"},
    )
    spec = apply_blocks(parse_spec({"blocks": {"cluster": f"kubernetes-training-cluster/{name}"}}))
    assert spec.cluster.kind == "kubernetes" and spec.cluster.kubernetes == KubernetesSpec(
        image="ghcr.io/o/p:1",
        namespace="train",
        gpus_per_node=8,
        node_selector={"gpu": "h100"},
        secret_env={"HF_TOKEN": SecretKeyRef(secret="hf", key="token")},
    )
    monkeypatch.setenv("KUBECONFIG", "/nonexistent/kubeconfig")  # refused before anything starts: no API configured
    with pytest.raises(SpecError, match="cluster.kind .kubernetes.: kubeconfig /nonexistent/kubeconfig does not exist"):
        resolve_campaign(parse_spec({"blocks": {"cluster": f"kubernetes-training-cluster/{name}"}}))


def test_tracking_round_trip_keeps_the_token_secret(on_prefect_server):
    name = _name("tracking")
    MlflowTracking(tracking_uri="http://127.0.0.1:5000", experiment="exp-a", token=SECRET).save(name)
    loaded = MlflowTracking.load(name)
    assert loaded.to_spec() == TrackingSpec(uri="http://127.0.0.1:5000", experiment="exp-a")
    for text in (repr(loaded), str(loaded), loaded.model_dump_json(), str(loaded.to_spec())):
        assert SECRET not in text
    assert loaded.environment() == {"MLFLOW_TRACKING_TOKEN": SECRET}
    assert MlflowTracking().environment() == {}
    with get_client(sync_client=True) as client:  # the API hands it out only when asked to
        doc = client.read_block_document_by_name(name, "mlflow-tracking", include_secrets=False)
    assert SECRET not in str(doc.data)


# ---- a campaign spec that names saved blocks ---------------------------------------------------
def test_spec_refers_to_saved_blocks_by_name(on_prefect_server, tmp_path, monkeypatch):
    names = {k: _name(k) for k in ("storage", "cluster", "tracking")}
    S3CampaignStorage(bucket_name="ckpt", credentials=_minio(), root=tmp_path).save(names["storage"])
    LocalProcessCluster(workers_per_node=1, max_restarts=0).save(names["cluster"])
    MlflowTracking(experiment="team-exp", token=SECRET).save(names["tracking"])
    spec = parse_spec(
        {
            "name": "c7",
            "blocks": {
                "storage": f"s3-campaign-storage/{names['storage']}",
                "cluster": f"local-process-cluster/{names['cluster']}",
                "tracking": f"mlflow-tracking/{names['tracking']}",
            },
        }
    )
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(var, raising=False)  # restored after the test
    before = dict(os.environ)
    resolved = resolve_campaign(spec)
    assert resolved.workdir_path == tmp_path.resolve() / "c7"
    assert (resolved.checkpoint.uri, resolved.checkpoint.s3_endpoint_url) == (
        "s3://ckpt/campaigns/c7",
        "http://127.0.0.1:9000",
    )
    assert resolved.cluster == ClusterSpec(workers_per_node=1, max_restarts=0)
    assert (resolved.tracking.experiment, resolved.tracking.uri) == ("team-exp", None)
    assert not resolved.blocks.any() and resolved.spec_hash() != spec.spec_hash()
    # the credentials travel with the resolved spec, in memory only; this process's environment
    # (which later runs of other campaigns inherit under deployments.serve) is left alone
    assert dict(os.environ) == before
    assert resolved.credentials.env["AWS_SECRET_ACCESS_KEY"] == SECRET == resolved.credentials.mlflow_token()
    assert resolved.credentials.child_env({})["AWS_SECRET_ACCESS_KEY"] == SECRET
    for text in (resolved.model_dump_json(), repr(resolved), repr(resolved.credentials), resolved.spec_hash()):
        assert SECRET not in text
    assert resolve_campaign(resolved) == resolved  # resolves once
    assert resolve_campaign(resolved).credentials == resolved.credentials
    # an explicit workdir (flow parameter, --workdir) wins over the storage block's
    assert resolve_campaign(spec, workdir=tmp_path / "elsewhere").workdir_path == tmp_path / "elsewhere"


def test_spec_block_errors_are_clear(on_prefect_server):
    with pytest.raises(SpecError, match=r"blocks.cluster and cluster both give the same settings"):
        parse_spec({"cluster": {"workers_per_node": 1}, "blocks": {"cluster": "local-process-cluster/x"}})
    with pytest.raises(SpecError, match=r"blocks.storage and workdir"):
        parse_spec({"workdir": "/tmp/x", "blocks": {"storage": "local-campaign-storage/x"}})
    with pytest.raises(
        SpecError, match=r"blocks.storage: 'nope' must name a saved block as 'local-campaign-storage/<name>'"
    ):
        apply_blocks(parse_spec({"blocks": {"storage": "nope"}}))
    with pytest.raises(
        SpecError, match=r"blocks.tracking: cannot load block 'mlflow-tracking/missing-.*prefect block register"
    ):
        apply_blocks(parse_spec({"blocks": {"tracking": f"mlflow-tracking/missing-{uuid.uuid4().hex[:6]}"}}))
    name = _name("wrong")
    MlflowTracking().save(name)
    with pytest.raises(SpecError, match=r"blocks.cluster: 'mlflow-tracking/.*' is a MlflowTracking block; expected"):
        apply_blocks(parse_spec({"blocks": {"cluster": f"mlflow-tracking/{name}"}}))


def test_s3_storage_credentials_reach_a_real_s3_server(on_prefect_server, seaweed, tmp_path, monkeypatch):
    """SeaweedFS checks signatures: the store the training processes open works with the block's
    credentials alone (no AWS variables set beforehand)."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(var, raising=False)
    name = _name("weed")
    S3CampaignStorage(
        bucket_name=s3_servers.BUCKET,
        prefix=f"blocks-{uuid.uuid4().hex[:6]}",
        root=tmp_path,
        credentials=MinIOCredentials(
            minio_root_user=s3_servers.ACCESS_KEY,
            minio_root_password=s3_servers.SECRET_KEY,
            region_name="us-east-1",
            aws_client_parameters=AwsClientParameters(endpoint_url=seaweed.endpoint),
        ),
    ).save(name)
    spec = resolve_campaign(parse_spec({"name": "c8", "blocks": {"storage": f"s3-campaign-storage/{name}"}}))
    store = checkpoint_store(spec, "main")
    store.write_json("probe.json", {"ok": True})
    assert store.read_json("probe.json") == {"ok": True} and store.location.startswith(f"s3://{s3_servers.BUCKET}/")
