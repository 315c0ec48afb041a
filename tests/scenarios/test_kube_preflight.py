"""Kubernetes preflight (API reachable, namespace, RBAC by SelfSubjectAccessReview) through the
unmodified official client against the API double, and the orchestrator RBAC it checks
(deploy/kubernetes/rbac.yaml is exactly that list, valid for the supported Kubernetes versions)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from kubernetes import config
from kubernetes_validate import validate

from pretrain.cluster.kube.manifests import NEWEST_K8S, OLDEST_K8S
from pretrain.cluster.kube.preflight import PreflightError, manifests_markdown, preflight
from pretrain.cluster.kube.rbac import REQUIRED, render
from support import kube_api as double
from support.campaigns import small_spec
from support.s3_servers import free_ports

ROOT = Path(__file__).resolve().parents[2]
EVERY_VERB = [(v, a.group, a.resource) for a in REQUIRED for v in a.verbs]


def _client(api: double.KubeAPI):
    return config.new_client_from_config(config_file=str(api.kubeconfig()))


@pytest.mark.parametrize(
    "allow, namespaces, expect",
    [
        # exactly the verbs of the Role: ready
        (EVERY_VERB, ("train",), []),
        # one verb short on pods, no logs: both named, with the RBAC to apply
        (
            [t for t in EVERY_VERB if t not in (("watch", "", "pods"), ("get", "", "pods/log"))],
            ("train",),
            [
                "may not watch pods, get pods/log",
                "kubectl apply",
                "resources: [pods], verbs: [watch]",
                "resources: [pods/log], verbs: [get]",
            ],
        ),
        # nothing granted: every resource listed in one message
        ([], ("train",), ["may not create/get/list/watch/delete/patch batch/jobs", "services", "pods/log"]),
        # the namespace is missing: said first, how to create it
        (EVERY_VERB, ("default",), ["namespace 'train' does not exist", "kubectl create namespace train"]),
    ],
    ids=["allowed", "verbs-denied", "nothing-allowed", "namespace-missing"],
)
def test_preflight_reports_every_problem_in_one_message(tmp_path, allow, namespaces, expect):
    with double.KubeAPI(tmp_path, namespaces=namespaces, allow=allow) as api:
        result = preflight(_client(api), "train")
    assert result.ok is (not expect), result.problems
    message = result.message()
    for words in expect:
        assert words in message
    if expect:
        assert len(result.problems) == 1 and api.url in message
        with pytest.raises(PreflightError, match="preflight of namespace 'train'"):
            result.raise_if_failed()
    else:
        result.raise_if_failed()


def test_an_unreachable_api_says_where_it_looked(tmp_path):
    with double.KubeAPI(tmp_path) as api:
        client = _client(api)
    (port,) = free_ports(1)  # the double is closed: nothing listens here
    double.point_at(client, f"http://127.0.0.1:{port}")
    result = preflight(client, "default")
    assert not result.ok and "does not answer" in result.message() and f"127.0.0.1:{port}" in result.message()
    assert "KUBECONFIG" in result.message()


def test_rejected_credentials(tmp_path):
    with double.KubeAPI(tmp_path) as api:
        path = api.kubeconfig()
        path.write_text(path.read_text().replace(api.token, "expired-token"))
        result = preflight(config.new_client_from_config(config_file=str(path)), "default")
    assert not result.ok and "rejected the credentials" in result.message()


def test_deployed_rbac_is_exactly_what_preflight_checks():
    text = (ROOT / "deploy/kubernetes/rbac.yaml").read_text()
    assert text == render(), "regenerate: python -m pretrain.cluster.kube.rbac > deploy/kubernetes/rbac.yaml"
    docs = list(yaml.safe_load_all(text))
    assert [d["kind"] for d in docs] == ["ServiceAccount", "Role", "RoleBinding"]
    granted = {
        (v, g, r)
        for rule in docs[1]["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert granted == set(EVERY_VERB)
    for version in (OLDEST_K8S, NEWEST_K8S):
        for doc in docs:
            validate(doc, version, strict=True)


def test_the_deployed_rbac_passes_preflight(tmp_path):
    """The Role of deploy/kubernetes/ granted (as the double's allow-list) → preflight is clean."""
    role = list(yaml.safe_load_all((ROOT / "deploy/kubernetes/rbac.yaml").read_text()))[1]
    allow = [
        (v, g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
    ]
    with double.KubeAPI(tmp_path, namespaces=("pretrain",), allow=allow) as api:
        assert preflight(_client(api), "pretrain").problems == []


# ---- provision-cluster: review artifact, then preflight, before anything starts --------------
def kube_spec(workdir: Path, **kube):
    return small_spec(
        workdir,
        cluster={
            "kind": "kubernetes",
            "workers_per_node": 2,
            "nodes_min": 1,
            "nodes_max": 2,
            "kubernetes": {"image": "pretrain:test", "namespace": "train", **kube},
        },
    )


def test_every_stage_is_rendered_for_review(tmp_path):
    spec = kube_spec(tmp_path)
    markdown = manifests_markdown(spec)
    for stage in spec.stages:
        assert f"## Stage {stage.name}" in markdown
    docs = [d for block in markdown.split("```yaml\n")[1:] for d in yaml.safe_load_all(block.split("```")[0])]
    assert [d["kind"] for d in docs] == ["Service", "Job"] * len(spec.stages)


def test_a_stage_that_cannot_fit_its_pod_fails_before_anything_starts(tmp_path):
    with pytest.raises(PreflightError, match="stage 'warmup': /dev/shm needs .* memory_per_node"):
        manifests_markdown(kube_spec(tmp_path, memory_per_node="100Mi"))


def test_provision_refuses_a_cluster_without_the_rbac(prefect_harness, tmp_path, monkeypatch):
    """The flow publishes the manifests, then stops at the preflight with the RBAC to apply:
    no object is created, no node check runs, the ledger records no cluster."""
    pytest.importorskip("pretrain.cluster.kube.client", reason="the backend's API client (k8s-backend) is not merged")
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.provision_cluster import provision_cluster
    from pretrain.state.ledger import Ledger
    from tasks.artifacts import artifact_key

    spec = kube_spec(tmp_path / "wd").model_copy(
        update={"name": "refused-rbac"}
    )  # its own artifact key in the shared harness
    allow = [t for t in EVERY_VERB if t[1] != "batch"]  # no Jobs at all
    with double.KubeAPI(tmp_path / "kube", namespaces=("train",), allow=allow) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig()))
        with pytest.raises(PreflightError, match="may not create/get/list/watch/delete/patch batch/jobs"):
            provision_cluster(spec)
        assert not [key for key in api.store.objects if key[0] in ("jobs", "pods", "services")]
    assert Ledger.open(spec).record.cluster is None
    with get_client(sync_client=True) as client:
        [artifact] = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[artifact_key("kubernetes-manifests", spec.name)])
            ),
            limit=1,
        )
    assert "## Stage warmup" in artifact.data and "kind: Job" in artifact.data
