"""The Kubernetes backend (``KubeCluster``/``KubeJobHandle``) end to end through the API
test double: the unmodified official client, the double's Job controller, and pods that run the
REAL node agent (``python -m trainer.launch``) as local processes on their own 127.x addresses.
(Pods that cannot start or run as asked: test_kube_cluster_start_failures.py.)"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from kubernetes import client

from pretrain.cluster.kube.client import KubeUnavailable, api_client
from pretrain.cluster.kube.cluster import KubeCluster
from pretrain.cluster.local import DONE_SILENT_S, ClusterError
from pretrain.run.jobs import build_job, write_job
from support import kube_api as double
from support.campaigns import kept_trajectory, seed_data, wait_for
from support.kube_cluster import NS, kube_spec, launch, live_pids, objects  # test_kube_*.py import them from here
from trainer.checkpoint.store import CheckpointStore
from trainer.common.process import signal_process
from trainer.job.reporting import EVENTS, read_all
from trainer.resilience.heartbeat import heartbeat_dir
from trainer.resilience.stacks import DUMP_SIGNAL, stack_path, take_dump

kube_api = double.kube_api  # the fixture


@contextmanager
def stacks_if_it_times_out(api: double.KubeAPI, job_dir: Path):
    """On a timeout inside: every node agent of the pods writes its threads' stacks to its pod's
    log and every worker to its ``.stack`` file (``trainer.resilience.stacks``), and the failure
    shows them with the logs' tails — for a hang seen once under load and not reproduced."""
    try:
        yield
    except pytest.fail.Exception as e:
        for pid in live_pids(api):
            with contextlib.suppress(psutil.Error):
                for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
                    if {"trainer.launch", "trainer.agent.node"} & set(proc.cmdline()):  # a node agent
                        signal_process(proc.pid, DUMP_SIGNAL)
        dumps = [
            take_dump(json.loads(path.read_text())["pid"], stack_path(path))
            for path in heartbeat_dir(job_dir).glob("*.json")
        ]
        logs = sorted(api.runner.workdir.rglob("*.log"))
        with contextlib.suppress(pytest.fail.Exception):  # the agents' dumps are written at once: a bound, not a wait
            wait_for(lambda: all("\nCurrent thread 0x" in log.read_text(errors="replace") for log in logs), 5, "")
        tails = ["\n".join([f"--- {log.name}", *log.read_text(errors="replace").splitlines()[-80:]]) for log in logs]
        pytest.fail("\n".join([str(e), *tails, *("--- a worker's stacks\n" + d for d in dumps if d)]))


def test_a_two_node_job_trains_to_completion_and_stop_leaves_nothing(kube_api, prepared_data, tmp_path):
    spec = kube_spec(tmp_path / "w")
    cluster, job, path = launch(kube_api, spec, prepared_data)
    handle = cluster.start(job, path, spec.layout)
    try:
        assert objects(kube_api)["jobs"] == [handle.name] and objects(kube_api)["services"] == [handle.name]
        code = handle.wait(timeout=240)
        assert code == 0, [p.read_text()[-3000:] for p in handle.logs if p.exists()]
        assert handle.lost_nodes() == {}
        assert (
            CheckpointStore.open(job.checkpoint.location).committed_steps()[0] == 6
        )  # the final checkpoint is committed (newest first)
        service = kube_api.store.get("services", NS, handle.name)
        assert service["metadata"]["ownerReferences"][0]["kind"] == "Job"  # it goes with the Job
    finally:
        handle.stop(grace_s=2)
    assert objects(kube_api) == {"jobs": [], "pods": [], "services": []}
    assert live_pids(kube_api) == []


def test_a_pod_deleted_mid_training_is_a_lost_node_and_the_job_goes_on(kube_api, prepared_data, tmp_path):
    spec = kube_spec(tmp_path / "w", steps=400, max_restarts=2)  # the survivor's agent restarts its workers once
    cluster, job, path = launch(kube_api, spec, prepared_data)
    handle = cluster.start(job, path, spec.layout)

    def checkpoints() -> list[int]:
        return [e["step"] for e in read_all(handle.job_dir / EVENTS) if e["event"] == "checkpoint"]

    try:
        wait_for(checkpoints, 180, "the first checkpoint of the 2-node job")
        kube_api.store.compact()  # the watch's resource version is gone: the handle must list afresh (410)
        victim = next(
            p for p in kube_api.store.find("pods", NS) if p["metadata"]["name"].startswith(f"{handle.name}-1-")
        )
        client.CoreV1Api(kube_api.client()).delete_namespaced_pod(victim["metadata"]["name"], NS)
        lost = wait_for(handle.lost_nodes, 60, "node 1 reported lost")
        assert list(lost) == [1], handle.verdicts()
        before = max(checkpoints())
        with stacks_if_it_times_out(kube_api, handle.job_dir):
            wait_for(lambda: max(checkpoints()) > before + 2, 120, "a checkpoint of node 0 training on alone")
        assert handle.poll() is None and list(handle.lost_nodes()) == [1]  # node 0 alone is ≥ nodes_min: it goes on
    finally:
        handle.stop(grace_s=2)
    assert objects(kube_api) == {"jobs": [], "pods": [], "services": []}
    assert live_pids(kube_api) == []


@pytest.mark.parametrize(
    "node_silent_s, slow, stopped, verdict",
    [
        # the survivor's steps slowed (0.2 s each, from step 5: after the freeze) so the probe acts while it trains;
        # slow: the frozen pod of the job-done case; the probe: test_kube_manifests, its verdict: test_kube_verdicts
        pytest.param(
            2,
            [{"kind": "slow_worker", "rank": 0, "step": 5, "delay_s": 0.2}],
            "its liveness probe stopped its pod",
            "stopped by its liveness probe",
            id="liveness-probe",
            marks=pytest.mark.slow,
        ),
        pytest.param(0, [], "deleted its pod", "was deleted", id="job-done"),  # no probe: the pod goes once done
    ],
)
def test_a_frozen_pod_is_stopped_and_named_a_lost_node(
    kube_api, prepared_data, tmp_path, node_silent_s, slow, stopped, verdict
):
    """freeze_node on Kubernetes: every process of node 1's pod stops (sockets open, nothing
    exits). The rendezvous drops it and node 0 trains on. The pod's liveness probe finds its
    agent's liveness file silent past ``kubernetes.node_silent_s`` and the kubelet kills it (137,
    nothing in the pod's status says why), or, without a probe, the handle deletes it once the
    job finished on node 0 and the agent missed a few beats: either way a frozen node, lost (not
    a worker failure), and nothing of it is left stopped behind."""
    from test_frozen_node import of_job

    spec = kube_spec(
        tmp_path / "w",
        steps=100,
        max_restarts=2,
        cluster={"node_timeout_s": 2},
        chaos=[{"kind": "freeze_node", "node": 1, "step": 4}, *slow],
        node_silent_s=node_silent_s,
    )
    cluster, job, path = launch(kube_api, spec, prepared_data)
    handle = cluster.start(job, path, spec.layout)
    try:
        assert handle.wait(timeout=120) == 0  # node 0 finished the stage alone
        assert handle.lost_nodes() == {1: 137}, handle.verdicts()
        assert handle.verdicts()[1].cause == "node_lost" and verdict in handle.verdicts()[1].message, handle.verdicts()
        assert handle.silent[1] >= (node_silent_s or DONE_SILENT_S) - 1  # finishedAt: whole seconds
        notices = handle.new_notices()
        assert [n for n in notices if "node 1 gave no sign of life" in n and stopped in n], notices
        assert handle.new_notices() == []  # said once
        assert kept_trajectory(read_all(handle.job_dir / "metrics.jsonl"), 100)[100]["world_size"] == 1
    finally:
        handle.stop(grace_s=2)
    assert objects(kube_api) == {"jobs": [], "pods": [], "services": []}
    assert live_pids(kube_api) == []
    wait_for(lambda: not of_job(handle.job_dir), 30, "no process of the job left")


def test_starting_a_launch_again_adopts_the_live_job(kube_api, prepared_data, tmp_path):
    spec = kube_spec(tmp_path / "w", steps=400)
    cluster, job, path = launch(kube_api, spec, prepared_data)
    first = cluster.start(job, path, spec.layout)
    try:
        wait_for(lambda: len(kube_api.store.find("pods", NS)) == 2, 30, "the first launch's 2 pods")
        uid = kube_api.store.get("jobs", NS, first.name)["metadata"]["uid"]
        assert cluster.live_job("s", 1) == f"{NS}/{first.name}" and cluster.live_job("s", 2) is None
        again = KubeCluster(spec, kube_api.client()).start(job, path, spec.layout)  # a re-run
        assert again.adopted and again.name == first.name and "adopted the live Job" in again.notices[0]
        assert kube_api.store.get("jobs", NS, first.name)["metadata"]["uid"] == uid
        assert objects(kube_api)["jobs"] == [first.name] and len(objects(kube_api)["pods"]) == 2
        assert again.poll() is None
    finally:
        first.stop(grace_s=1)
    assert again.poll() is not None and cluster.live_job("s", 1) is None  # the adopted handle sees the job gone
    again.stop(grace_s=1)  # idempotent
    assert objects(kube_api) == {"jobs": [], "pods": [], "services": []}
    assert live_pids(kube_api) == []


def test_a_campaign_on_kubernetes_trains_its_stage_and_leaves_no_object(
    prefect_harness, kube_api, prepared_data, tmp_path, monkeypatch
):
    from flows.campaign import pretrain_campaign

    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig()))  # the flow's API client comes from its environment
    spec = kube_spec(tmp_path / "w", steps=4)
    seed_data(spec, prepared_data)
    status = pretrain_campaign(spec=spec)
    assert status["status"] == "completed", status
    stage = status["stages"][0]
    assert stage["status"] == "completed" and stage["good_checkpoint"]["step"] == 4 and stage["failures"] == []
    assert objects(kube_api) == {"jobs": [], "pods": [], "services": []}  # torn down after success
    assert live_pids(kube_api) == []
    logs = sorted((spec.workdir_path / "jobs").rglob("node*.log"))  # the pods' logs, copied before they went
    assert [p.name for p in logs] == ["node0.log", "node1.log"]


def test_a_new_launch_of_the_stage_retires_a_live_job_of_an_earlier_launch(kube_api, prepared_data, tmp_path):
    """A flow process died; its re-run launches the stage's next attempt: the orphaned Job of the
    earlier attempt must not train beside it (the campaign's lock says its orchestrator is gone)."""
    spec = kube_spec(tmp_path / "w", steps=400)
    cluster, job, path = launch(kube_api, spec, prepared_data, attempt=1)
    orphan = cluster.start(job, path, spec.layout)
    wait_for(lambda: len(kube_api.store.find("pods", NS)) == 2, 30, "the orphaned launch's 2 pods")
    job2 = build_job(spec, 0, 2, None)
    handle = KubeCluster(spec, kube_api.client()).start(job2, write_job(job2), spec.layout)
    try:
        assert handle.name != orphan.name and objects(kube_api)["jobs"] == [handle.name]
        assert objects(kube_api)["services"] == [handle.name]
        assert all(p.startswith(handle.name) for p in objects(kube_api)["pods"])
        assert f"deleted Job default/{orphan.name}" in handle.notices[0]
    finally:
        handle.stop(grace_s=1)
        orphan.stop(grace_s=1)
    assert objects(kube_api) == {"jobs": [], "pods": [], "services": []}


def test_the_api_client_comes_from_a_kubeconfig_or_a_prefect_cluster_config_block(kube_api, tmp_path):
    from prefect_kubernetes.credentials import KubernetesClusterConfig

    config = kube_api.kubeconfig()
    for api in (
        api_client(env={"KUBECONFIG": str(config)}),
        api_client(kubeconfig=config),
        api_client(
            cluster_config=KubernetesClusterConfig(config=json.loads(config.read_text()), context_name="double")
        ),
    ):
        with api:
            assert client.CoreV1Api(api).read_namespace(NS).metadata.name == NS
    with pytest.raises(KubeUnavailable, match="set KUBECONFIG"):
        api_client(env={"HOME": str(tmp_path)})
    with pytest.raises(KubeUnavailable, match="gone.yaml does not exist"):
        api_client(env={"KUBECONFIG": str(tmp_path / "gone.yaml")})


def test_excluded_nodes_start_fewer_pods_and_too_few_is_refused(kube_api, prepared_data, tmp_path):
    spec = kube_spec(tmp_path / "w", steps=400)
    cluster, job, path = launch(kube_api, spec, prepared_data)
    with pytest.raises(ClusterError, match="only 0 healthy node.*nodes_min is 1"):
        cluster.start(job, path, spec.layout, exclude={0, 1})
    assert objects(kube_api) == {"jobs": [], "pods": [], "services": []}
    handle = cluster.start(job, path, spec.layout, exclude={1})
    try:
        wait_for(
            lambda: handle.verdicts().get(0) and handle.verdicts()[0].state == "running", 30, "the one pod running"
        )
        assert kube_api.store.get("jobs", NS, handle.name)["spec"]["completions"] == 1
        assert len(objects(kube_api)["pods"]) == 1
    finally:
        handle.stop(grace_s=1)


def test_stop_with_the_api_gone_says_how_to_finish_the_teardown(prepared_data, tmp_path):
    spec = kube_spec(tmp_path / "w", image="registry.example/never:pulled")
    with double.KubeAPI(tmp_path / "kube") as api:
        api.runner.unpullable.add("registry.example/never:pulled")  # no process: only the API's objects matter here
        cluster, job, path = launch(api, spec, prepared_data)
        handle = cluster.start(job, path, spec.layout)
    # the API's address from now on: a port held bound and never listening (the closed double's own port
    # could be taken meanwhile by another test's API server, which would then answer the teardown)
    with socket.socket() as gone:
        gone.bind(("127.0.0.1", 0))
        double.point_at(handle.api, f"http://127.0.0.1:{gone.getsockname()[1]}")
        with pytest.raises(
            ClusterError, match=f"could not tear down Job default/{handle.name}.*kubectl -n default delete job"
        ):
            handle.stop(grace_s=0)
    assert not [t for t in threading.enumerate() if t.name == f"kube-watch-{handle.name}"]  # no watcher outlives it
