"""Kubernetes launches whose pods cannot start or run as asked, through the API test double (the
backend end to end: test_kube_cluster.py): an image that cannot be pulled, a pod no node can take,
a Job that makes no pod, an optional standby pod no node has room for, a node agent that fails."""

from __future__ import annotations

import pytest

from pretrain.cluster.kube.handle import KubeJobHandle
from pretrain.cluster.local import ClusterError
from pretrain.run.incidents import NON_RETRYABLE, cause_of
from support import kube_api as double
from support.campaigns import seed_data
from support.kube_cluster import NS, kube_spec, launch, objects
from trainer.job.reporting import EVENTS, read_all

kube_api = double.kube_api  # the fixture


def test_an_unpullable_image_fails_fast_as_a_configuration_error(kube_api, prepared_data, tmp_path):
    spec = kube_spec(tmp_path / "w", image="registry.example/pretrain:missing")
    kube_api.runner.unpullable.add("registry.example/pretrain:missing")
    cluster, job, path = launch(kube_api, spec, prepared_data)
    handle = cluster.start(job, path, spec.layout)
    try:
        code = handle.wait(timeout=60)
        assert code not in (None, 0)
        events = read_all(handle.job_dir / EVENTS)
        cause = cause_of(events, code)
        assert cause == "kube_config" and cause in NON_RETRYABLE  # the campaign stops: relaunching cannot help
        error = next(e["error"] for e in events if e["event"] == "error")
        assert "registry.example/pretrain:missing" in error and "cluster.kubernetes.image" in error
        assert any("cluster.kubernetes.image" in tail for tail in handle.failure_logs().values())
    finally:
        handle.stop(grace_s=1)
    assert objects(kube_api) == {"jobs": [], "pods": [], "services": []}


def test_a_pod_no_node_can_take_fails_after_the_timeout_as_a_configuration_error(kube_api, prepared_data, tmp_path):
    spec = kube_spec(tmp_path / "w", gpus_per_node=1)
    kube_api.runner.unschedulable.add("nvidia.com/gpu")
    cluster, job, path = launch(kube_api, spec, prepared_data)
    handle = cluster.start(job, path, spec.layout)
    try:
        code = handle.wait(timeout=60)
        events = read_all(handle.job_dir / EVENTS)
        assert cause_of(events, code) == "kube_config"
        assert "Insufficient nvidia.com/gpu" in events[-1]["error"] and "gpus_per_node" in events[-1]["error"]
    finally:
        handle.stop(grace_s=1)
    assert objects(kube_api) == {"jobs": [], "pods": [], "services": []}


def test_a_standby_pod_no_node_has_room_for_is_left_out_and_the_job_trains_without_it(
    kube_api, prepared_data, tmp_path
):
    """A standby pod (``spare_nodes``) is optional: when no node has room for it the job trains on
    its two nodes and succeeds, the standby is named once as a notice (not a configuration error,
    not a lost node), and no standby is counted on to replace a lost node."""
    spec = kube_spec(tmp_path / "w", steps=20, cluster={"nodes_min": 2, "spare_nodes": 1})
    kube_api.runner.no_room_for.add(2)
    cluster, job, path = launch(kube_api, spec, prepared_data)
    handle = cluster.start(job, path, spec.layout)
    try:
        assert handle.spare_nodes == 1
        notices: list[str] = []
        code = None
        while code is None:
            code = handle.wait(timeout=0.5)
            notices += handle.new_notices()
            assert handle.lost_nodes() == {}
        assert code == 0 and handle.spare_nodes == 0
        assert len(notices) == 1 and "standby node 2 cannot run" in notices[0] and "Insufficient cpu" in notices[0], (
            notices
        )
        assert "spare_nodes" in notices[0] and handle.new_notices() == []
        assert not any(e["event"] == "error" for e in read_all(handle.job_dir / EVENTS))
    finally:
        handle.stop(grace_s=1)
    assert objects(kube_api) == {"jobs": [], "pods": [], "services": []}


def test_a_failed_worker_s_log_tail_is_kept_for_the_flow_and_in_the_job_directory(kube_api, prepared_data, tmp_path):
    spec = kube_spec(tmp_path / "w")
    cluster, job, _ = launch(kube_api, spec, prepared_data)
    handle = cluster.start(job, tmp_path / "no-such-job.json", spec.layout)  # the agent fails
    try:
        code = handle.wait(timeout=120)
        assert code not in (None, 0) and cause_of(read_all(handle.job_dir / EVENTS), code).startswith("worker_failure")
        tails = handle.failure_logs()
        assert set(tails) == {0, 1} and all("no-such-job.json" in t for t in tails.values()), tails
        assert "no-such-job.json" in handle.logs[0].read_text()
    finally:
        handle.stop(grace_s=1)


def test_a_job_that_makes_no_pod_in_time_is_a_configuration_error(kube_api, tmp_path):
    """E.g. a ResourceQuota refuses the pods: the Job exists, its pods never do."""
    handle = KubeJobHandle(kube_api.client(), NS, "pt-quota", "pretrain.io/campaign=none", 2, 1, tmp_path / "job", 1.0)
    handle.begin()
    try:
        code = handle.wait(timeout=30)
        events = read_all(tmp_path / "job" / EVENTS)
        assert code not in (None, 0) and cause_of(events, code) == "kube_config"
        assert "made no pod for node(s) [0, 1]" in events[-1]["error"] and "ResourceQuota" in events[-1]["error"]
    finally:
        handle.stop(grace_s=0)


def test_a_campaign_whose_image_cannot_be_pulled_stops_at_the_node_check_before_any_training(
    prefect_harness, kube_api, prepared_data, tmp_path, monkeypatch
):
    """The node check runs in pods of the training pods' shape: an unpullable image stops the
    campaign while provisioning, with what to fix, and no training job is ever launched."""
    from flows.campaign import pretrain_campaign
    from pretrain.state.ledger import Ledger

    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig()))
    kube_api.runner.unpullable.add("registry.example/pretrain:typo")
    spec = kube_spec(tmp_path / "w", steps=4, image="registry.example/pretrain:typo")
    seed_data(spec, prepared_data)
    with pytest.raises(
        ClusterError,
        match=r"node health check: 0 healthy node\(s\).*ImagePullBackOff.*"
        r"check cluster.kubernetes.image",
    ):
        pretrain_campaign(spec=spec)
    assert Ledger.open(spec).stage("s").attempts == 0
    assert objects(kube_api) == {"jobs": [], "pods": [], "services": []}
