"""Against a real Kubernetes cluster (kind, minikube, any): run with

    KUBECONFIG=~/.kube/config PRETRAIN_K8S_NAMESPACE=pretrain pytest -m kubernetes -n0

Deselected by default (marker ``kubernetes``) and skipped when no KUBECONFIG names a readable
file. What it proves on the real API server: the preflight passes with the deployed RBAC, the
server (its admission, its own schema) accepts every stage's manifests, and a launch's objects
are found by its labels and leave nothing behind after a foreground delete. Jobs are created
suspended, so no pod is scheduled and no image is pulled. The training scenarios (2 nodes to
completion, a pod lost, an unpullable image, adopt on re-run, stop) join this file with the
backend's ``KubernetesCluster``.

Environment: ``PRETRAIN_K8S_NAMESPACE`` (default ``default``; it must exist, with
deploy/kubernetes/rbac.yaml applied there or equivalent access), ``PRETRAIN_K8S_IMAGE`` (only
written into the manifests here).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from conftest import small_spec, wait_for
from pretrain.kube.manifests import launch_labels, stage_launch
from pretrain.kube.preflight import preflight

KUBECONFIG = os.environ.get("KUBECONFIG", "")
NAMESPACE = os.environ.get("PRETRAIN_K8S_NAMESPACE", "default")
IMAGE = os.environ.get("PRETRAIN_K8S_IMAGE", "ghcr.io/example-org/prefect-pretrain:latest")

pytestmark = [
    pytest.mark.kubernetes,
    pytest.mark.skipif(not (KUBECONFIG and all(Path(p).is_file() for p in KUBECONFIG.split(os.pathsep))),
                       reason="no real cluster: set KUBECONFIG to a kubeconfig file (and run with -m kubernetes)"),
]


@pytest.fixture
def api():
    from kubernetes import config

    client = config.new_client_from_config(config_file=KUBECONFIG.split(os.pathsep)[0])
    yield client
    client.close()


def launch(tmp_path: Path, attempt: int = 1):
    spec = small_spec(tmp_path / "wd", name=f"kube-real-{uuid.uuid4().hex[:8]}", cluster={
        "kind": "kubernetes", "workers_per_node": 1, "nodes_min": 1, "nodes_max": 2,
        "kubernetes": {"image": IMAGE, "namespace": NAMESPACE, "cpu_per_node": "100m", "memory_per_node": "1Gi",
                       "ttl_seconds_after_finished": 600}})
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
    wait_for(lambda: not (batch.list_namespaced_job(NAMESPACE, label_selector=sel).items
                          or core.list_namespaced_service(NAMESPACE, label_selector=sel).items
                          or core.list_namespaced_pod(NAMESPACE, label_selector=sel).items),
             timeout=120, what=f"the objects of {sel} to be gone", interval=1.0)


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
