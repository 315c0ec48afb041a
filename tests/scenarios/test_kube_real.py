"""Against a real Kubernetes cluster (kind, minikube, any): run with

    KUBECONFIG=~/.kube/config PRETRAIN_K8S_NAMESPACE=pretrain pytest -m kubernetes -n0

Deselected by default (marker ``kubernetes``) and skipped when no KUBECONFIG names a readable
file. What it proves on the real API server: the preflight passes with the deployed RBAC, the
server (its admission, its own schema) accepts every stage's manifests, and a launch's objects
are found by its labels and leave nothing behind after a foreground delete. Jobs are created
suspended, so no pod is scheduled and no image is pulled. The training scenarios (2 nodes to
completion, a pod lost, the node check, stop) run the backend's ``KubeCluster`` and need a
workdir shared between this process and the pods (see below); an unpullable image needs none.

Environment: ``PRETRAIN_K8S_NAMESPACE`` (default ``default``; it must exist, with
deploy/kubernetes/rbac.yaml applied there or equivalent access), ``PRETRAIN_K8S_IMAGE`` (this
project's image, built from the Dockerfile), ``PRETRAIN_K8S_WORKDIR`` + ``PRETRAIN_K8S_WORKDIR_CLAIM``
(the shared workdir of the training scenarios).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from pretrain.cluster.kube.manifests import label_value, launch_labels, stage_launch
from pretrain.cluster.kube.preflight import preflight
from support.campaigns import small_spec, wait_for

KUBECONFIG = os.environ.get("KUBECONFIG", "")
NAMESPACE = os.environ.get("PRETRAIN_K8S_NAMESPACE", "default")
IMAGE = os.environ.get("PRETRAIN_K8S_IMAGE", "ghcr.io/example-org/prefect-pretrain:latest")

pytestmark = [
    pytest.mark.kubernetes,
    pytest.mark.skipif(
        not (KUBECONFIG and all(Path(p).is_file() for p in KUBECONFIG.split(os.pathsep))),
        reason="no real cluster: set KUBECONFIG to a kubeconfig file (and run with -m kubernetes)",
    ),
]


@pytest.fixture
def api():
    from kubernetes import config

    client = config.new_client_from_config(config_file=KUBECONFIG.split(os.pathsep)[0])
    yield client
    client.close()


def launch(tmp_path: Path, attempt: int = 1):
    spec = small_spec(
        tmp_path / "wd",
        name=f"kube-real-{uuid.uuid4().hex[:8]}",
        cluster={
            "kind": "kubernetes",
            "workers_per_node": 1,
            "nodes_min": 1,
            "nodes_max": 2,
            "kubernetes": {
                "image": IMAGE,
                "namespace": NAMESPACE,
                "cpu_per_node": "100m",
                "memory_per_node": "1Gi",
                "ttl_seconds_after_finished": 600,
            },
        },
    )
    return spec, stage_launch(spec, spec.stages[0].name, attempt)


def selector(spec, the_launch) -> str:
    labels = launch_labels(spec.name, the_launch.job.stage, the_launch.job.attempt)
    return ",".join(f"{k}={v}" for k, v in labels.items())


def remove(api, spec, the_launch) -> None:
    """Delete the launch's objects (foreground: the Job's pods first) and wait until none is left."""
    from kubernetes import client

    batch, core, sel = client.BatchV1Api(api), client.CoreV1Api(api), selector(spec, the_launch)
    for job in batch.list_namespaced_job(NAMESPACE, label_selector=sel).items:
        batch.delete_namespaced_job(job.metadata.name, NAMESPACE, propagation_policy="Foreground")
    for svc in core.list_namespaced_service(NAMESPACE, label_selector=sel).items:
        core.delete_namespaced_service(svc.metadata.name, NAMESPACE)
    wait_for(
        lambda: (
            not (
                batch.list_namespaced_job(NAMESPACE, label_selector=sel).items
                or core.list_namespaced_service(NAMESPACE, label_selector=sel).items
                or core.list_namespaced_pod(NAMESPACE, label_selector=sel).items
            )
        ),
        timeout=120,
        what=f"the objects of {sel} to be gone",
        interval=1.0,
    )


def test_preflight_passes(api):
    result = preflight(api, NAMESPACE)
    assert result.ok, result.message()


def test_the_server_accepts_every_stage(api, tmp_path):
    """Server-side dry run: the API server's validation and admission, nothing created."""
    from kubernetes import client

    spec, _ = launch(tmp_path)
    for stage in spec.stages:
        service, job = stage_launch(spec, stage.name).manifests()
        client.CoreV1Api(api).create_namespaced_service(NAMESPACE, service, dry_run="All")
        client.BatchV1Api(api).create_namespaced_job(NAMESPACE, job, dry_run="All")


def test_a_launch_is_found_by_its_labels_and_deleted_without_leftovers(api, tmp_path):
    from kubernetes import client

    spec, the_launch = launch(tmp_path, attempt=2)
    service, job = the_launch.manifests()
    job["spec"]["suspend"] = True  # no pod, no image pull: only the objects' lifecycle is tested
    try:
        client.CoreV1Api(api).create_namespaced_service(NAMESPACE, service)
        client.BatchV1Api(api).create_namespaced_job(NAMESPACE, job)
        found = client.BatchV1Api(api).list_namespaced_job(NAMESPACE, label_selector=selector(spec, the_launch)).items
        assert [j.metadata.name for j in found] == [the_launch.name]
        assert found[0].spec.completion_mode == "Indexed" and found[0].spec.completions == 2
    finally:
        remove(api, spec, the_launch)


# -- training scenarios: the backend (KubeCluster) on the real cluster. The pods and this
# process must share the campaign workdir: PRETRAIN_K8S_WORKDIR (a directory this process sees)
# is the mount of the ReadWriteMany claim PRETRAIN_K8S_WORKDIR_CLAIM in every pod, at the same
# path (e.g. kind with an extraMount and a hostPath PersistentVolume); PRETRAIN_K8S_IMAGE must be
# this project's image (Dockerfile). Without them these scenarios skip, saying so.
SHARED = os.environ.get("PRETRAIN_K8S_WORKDIR", "")
CLAIM = os.environ.get("PRETRAIN_K8S_WORKDIR_CLAIM", "")
needs_shared_workdir = pytest.mark.skipif(
    not (SHARED and CLAIM and os.environ.get("PRETRAIN_K8S_IMAGE")),
    reason="training on a real cluster needs PRETRAIN_K8S_WORKDIR + PRETRAIN_K8S_WORKDIR_CLAIM (a shared workdir) "
    "and PRETRAIN_K8S_IMAGE (this project's image)",
)


def training_spec(root: Path, steps: int = 6, image: str = IMAGE, **cluster):
    """2 nodes × 1 worker of a tiny model, checkpoints every 2 steps, on the shared workdir."""
    from pretrain.cluster.ports import free_port

    return small_spec(
        root / f"kube-real-{uuid.uuid4().hex[:8]}",
        name=f"kube-real-{uuid.uuid4().hex[:8]}",
        cluster={
            "kind": "kubernetes",
            "workers_per_node": 1,
            "nodes_min": 1,
            "nodes_max": 2,
            "threads_per_worker": 1,
            **cluster,
            "kubernetes": {
                "image": image,
                "namespace": NAMESPACE,
                "cpu_per_node": "1",
                "memory_per_node": "2Gi",
                "workdir_claim": CLAIM or None,
                "rdzv_port": free_port(span=2),
                "ttl_seconds_after_finished": 600,
            },
        },
        stages=[{"name": "s", "steps": steps, "seq_len": 32, "micro_batch": 2, "warmup_steps": 1}],
        checkpoint={"interval": 2, "memory_interval": 0, "keep": 4},
    )


def start_job(api, spec, prepared_data=None, exclude: frozenset = frozenset()):
    from pretrain.cluster.kube.cluster import KubeCluster
    from pretrain.run.jobs import build_job, write_job
    from support.campaigns import seed_data

    if prepared_data is not None:
        seed_data(spec, prepared_data)
    job = build_job(spec, 0, 1, None)
    cluster = KubeCluster(spec, api, unschedulable_after_s=300.0)  # a real node may pull the image for minutes
    return cluster, job, cluster.start(job, write_job(job), spec.layout, set(exclude))


def assert_nothing_left(api, spec) -> None:
    from kubernetes import client

    sel = f"pretrain.io/campaign={label_value(spec.name)}"
    assert not client.BatchV1Api(api).list_namespaced_job(NAMESPACE, label_selector=sel).items
    assert not client.CoreV1Api(api).list_namespaced_pod(NAMESPACE, label_selector=sel).items
    assert not client.CoreV1Api(api).list_namespaced_service(NAMESPACE, label_selector=sel).items


def test_an_unpullable_image_fails_fast_as_a_configuration_error(api, tmp_path, prepared_data):
    """No shared workdir needed: the pods never start."""
    from pretrain.run.incidents import NON_RETRYABLE, cause_of
    from trainer.job.reporting import EVENTS, read_all

    spec = training_spec(tmp_path, image="registry.invalid/prefect-pretrain:does-not-exist")
    _, job, handle = start_job(api, spec, prepared_data)
    try:
        code = handle.wait(timeout=300)
        cause = cause_of(read_all(Path(job.job_dir) / EVENTS), code)
        assert cause == "kube_config" and cause in NON_RETRYABLE, handle.verdicts()
    finally:
        handle.stop(grace_s=5)
    assert_nothing_left(api, spec)


@needs_shared_workdir
def test_the_node_check_runs_in_pods_and_records_their_nodes(api):
    from pretrain.cluster.kube.cluster import KubeCluster

    spec = training_spec(Path(SHARED))
    rows = KubeCluster(spec, api, unschedulable_after_s=300.0).health_check(spec.workdir_path)
    assert [(r["node"], r["ok"]) for r in rows] == [(0, True), (1, True)], rows
    assert all(r["host"] and r["allreduce_MBps"] > 0 for r in rows)
    assert_nothing_left(api, spec)


@needs_shared_workdir
def test_a_two_node_stage_trains_to_completion(api, prepared_data):
    from trainer.checkpoint.store import CheckpointStore

    spec = training_spec(Path(SHARED))
    _, job, handle = start_job(api, spec, prepared_data)
    try:
        assert handle.wait(timeout=900) == 0, handle.failure_logs()
        assert CheckpointStore.open(job.checkpoint.location).committed_steps()[0] == 6
    finally:
        handle.stop(grace_s=10)
    assert_nothing_left(api, spec)


@needs_shared_workdir
def test_a_pod_deleted_mid_training_is_a_lost_node_and_the_job_goes_on(api, prepared_data):
    from kubernetes import client

    from trainer.job.reporting import EVENTS, read_all

    spec = training_spec(Path(SHARED), steps=2000, max_restarts=2)
    _, job, handle = start_job(api, spec, prepared_data)

    def checkpoints() -> list[int]:
        path = Path(job.job_dir) / EVENTS
        return [e["step"] for e in read_all(path) if e["event"] == "checkpoint"] if path.exists() else []

    try:
        wait_for(checkpoints, 900, "the first checkpoint of the 2-node job", interval=2.0)
        pod = next(v.name for v in handle.verdicts().values() if v.index == 1)
        client.CoreV1Api(api).delete_namespaced_pod(pod, NAMESPACE)
        assert list(wait_for(handle.lost_nodes, 120, "node 1 reported lost", interval=1.0)) == [1]
        before = max(checkpoints())
        wait_for(lambda: max(checkpoints()) > before + 2, 300, "node 0 training on alone", interval=2.0)
        assert handle.poll() is None
    finally:
        handle.stop(grace_s=10)
    assert_nothing_left(api, spec)


@needs_shared_workdir
def test_a_standby_pod_takes_a_deleted_pods_place(api, prepared_data):
    """``spare_nodes``: a third pod stands by; node 1's pod deleted, it joins in its place and the
    job (nodes_min 2) goes on with two nodes."""
    from kubernetes import client

    from trainer.job.reporting import EVENTS, read_all

    spec = training_spec(Path(SHARED), steps=2000, max_restarts=2, nodes_min=2, spare_nodes=1)
    _, job, handle = start_job(api, spec, prepared_data)

    def events(kind: str) -> list[dict]:
        path = Path(job.job_dir) / EVENTS
        return [e for e in read_all(path) if e["event"] == kind] if path.exists() else []

    try:
        wait_for(lambda: events("checkpoint"), 900, "the first checkpoint of the 2-node job", interval=2.0)
        pod = next(v.name for v in handle.verdicts().values() if v.index == 1)
        client.CoreV1Api(api).delete_namespaced_pod(pod, NAMESPACE)
        assert list(wait_for(handle.lost_nodes, 120, "node 1 reported lost", interval=1.0)) == [1]
        wait_for(
            lambda: any(e.get("node") == 2 for e in events("start")), 300, "the standby pod's workers", interval=2.0
        )
        before = max(e["step"] for e in events("checkpoint"))
        wait_for(
            lambda: max(e["step"] for e in events("checkpoint")) > before + 2,
            300,
            "two nodes training on",
            interval=2.0,
        )
        assert handle.poll() is None
    finally:
        handle.stop(grace_s=10)
    assert_nothing_left(api, spec)


@needs_shared_workdir
def test_stopping_a_running_job_leaves_nothing_behind(api, prepared_data):
    """What the flow does on Prefect cancellation or SIGTERM: stop() = foreground delete, then wait."""
    spec = training_spec(Path(SHARED), steps=2000)
    _, _, handle = start_job(api, spec, prepared_data)
    try:
        wait_for(
            lambda: [v for v in handle.verdicts().values() if v.state == "running"], 900, "a running pod", interval=2.0
        )
    finally:
        handle.stop(grace_s=10)
    assert handle.poll() is not None
    assert_nothing_left(api, spec)
