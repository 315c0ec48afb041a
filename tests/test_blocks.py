"""The Prefect blocks: Prefect's standard block checks, save/load round trips against a real
(test-harness) server, secrets kept out of reprs and dumps, and ``prefect block register``."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from pydantic import ValidationError
from prefect.blocks.core import Block
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL
from prefect.testing.standard_test_suites import BlockStandardTestSuite

import blocks
from blocks import LocalCampaignStorage, LocalProcessCluster, MlflowTracking
from pretrain.spec import ClusterSpec, TrackingSpec

ROOT = Path(__file__).resolve().parents[1]
SECRET = "tok-" + uuid.uuid4().hex


class _OfflineBlockSuite(BlockStandardTestSuite):
    def test_has_a_valid_image(self, block: type[Block]) -> None:
        # The upstream check downloads the logo; these machines have no network, and the logo is
        # optional. Check what can be checked offline.
        assert block._logo_url is None or str(block._logo_url).startswith("https://")


class TestLocalCampaignStorageStandard(_OfflineBlockSuite):
    @pytest.fixture
    def block(self) -> type[Block]:
        return LocalCampaignStorage


class TestLocalProcessClusterStandard(_OfflineBlockSuite):
    @pytest.fixture
    def block(self) -> type[Block]:
        return LocalProcessCluster


class TestMlflowTrackingStandard(_OfflineBlockSuite):
    @pytest.fixture
    def block(self) -> type[Block]:
        return MlflowTracking


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_package_exports_every_block():
    assert sorted(blocks.__all__) == ["LocalCampaignStorage", "LocalProcessCluster", "MlflowTracking"]
    slugs = {getattr(blocks, n).get_block_type_slug() for n in blocks.__all__}
    assert slugs == {"local-campaign-storage", "local-process-cluster", "mlflow-tracking"}


def test_storage_round_trip(prefect_harness, tmp_path):
    name = _name("storage")
    LocalCampaignStorage(root=tmp_path / "campaigns").save(name)
    loaded = LocalCampaignStorage.load(name)
    assert loaded.workdir_for("tiny") == (tmp_path / "campaigns" / "tiny").resolve()


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "../escape", "/abs"])
def test_storage_rejects_names_that_leave_the_root(tmp_path, bad):
    with pytest.raises(ValueError, match="single path component"):
        LocalCampaignStorage(root=tmp_path).workdir_for(bad)


def test_cluster_mirrors_cluster_spec():
    assert set(LocalProcessCluster.model_fields) == set(ClusterSpec.model_fields) - {"kind"}
    assert LocalProcessCluster().to_spec() == ClusterSpec()


def test_cluster_round_trip(prefect_harness):
    name = _name("cluster")
    values = dict(workers_per_node=4, nodes_min=1, nodes_max=2, max_restarts=5, backend="gloo", threads_per_worker=1)
    LocalProcessCluster(**values).save(name)
    assert LocalProcessCluster.load(name).to_spec() == ClusterSpec(kind="local", **values)


def test_cluster_rejects_what_the_spec_rejects():
    with pytest.raises(ValidationError, match="nodes_min"):
        LocalProcessCluster(nodes_min=3, nodes_max=2)
    with pytest.raises(ValidationError):
        LocalProcessCluster(workers_per_node=0)


def test_tracking_round_trip_keeps_the_token_secret(prefect_harness):
    name = _name("tracking")
    MlflowTracking(tracking_uri="http://127.0.0.1:5000", experiment="exp-a", token=SECRET).save(name)
    loaded = MlflowTracking.load(name)
    assert loaded.to_spec() == TrackingSpec(uri="http://127.0.0.1:5000", experiment="exp-a")
    for text in (repr(loaded), str(loaded), loaded.model_dump_json(), str(loaded.to_spec())):
        assert SECRET not in text
    assert loaded.auth_env() == {"MLFLOW_TRACKING_TOKEN": SECRET}
    with get_client(sync_client=True) as client:  # the API hands it out only when asked to
        doc = client.read_block_document_by_name(name, "mlflow-tracking", include_secrets=False)
    assert SECRET not in str(doc.data)


def test_tracking_without_token():
    block = MlflowTracking()
    assert block.auth_env() == {}
    assert block.to_spec() == TrackingSpec(uri=None, experiment="pretrain")


def test_prefect_block_register_cli(prefect_harness, tmp_path):
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "prefect", "block", "register", "-m", "blocks"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Successfully registered 3 blocks" in proc.stdout, proc.stdout
    with get_client(sync_client=True) as client:
        for slug in ("local-campaign-storage", "local-process-cluster", "mlflow-tracking"):
            assert client.read_block_type_by_slug(slug).slug == slug
