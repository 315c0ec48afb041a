"""The Kubernetes API test double, driven through the unmodified official ``kubernetes`` client:
the API server's own semantics (watches, conflicts and Status bodies, access reviews, tokens, label
selectors). Its Job controller and pod runner: ``test_kube_workloads.py``."""

from __future__ import annotations

import json

import psutil
import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.watch import Watch

from support import kube_api as double
from support import kube_client_bodies as bodies
from support.campaigns import wait_for
from support.kube_client_bodies import NS, SLEEP, bare_pod, job
from support.kube_store import label_matcher

kube_api, api = double.kube_api, bodies.api  # the fixtures
KubeAPI = double.KubeAPI


def test_watch_from_a_resource_version_sees_each_change_once_and_an_expired_one_is_410(kube_api, api):
    coord = client.CoordinationV1Api(api)
    since = coord.list_namespaced_lease(NS).metadata.resource_version
    lease = client.V1Lease(
        metadata=client.V1ObjectMeta(name="campaign", labels={"app": "pretrain"}),
        spec=client.V1LeaseSpec(holder_identity="a", lease_duration_seconds=15),
    )
    coord.create_namespaced_lease(NS, lease)
    coord.create_namespaced_lease(NS, client.V1Lease(metadata=client.V1ObjectMeta(name="other", labels={"app": "x"})))
    coord.patch_namespaced_lease("campaign", NS, {"spec": {"holderIdentity": "b"}})
    coord.delete_namespaced_lease("campaign", NS)
    seen = [
        (e["type"], e["object"].spec.holder_identity, e["object"].metadata.resource_version)
        for e in Watch().stream(
            coord.list_namespaced_lease, NS, label_selector="app=pretrain", resource_version=since, timeout_seconds=1
        )
    ]  # the server ends it
    assert [(t, h) for t, h, _ in seen] == [("ADDED", "a"), ("MODIFIED", "b"), ("DELETED", "b")]
    versions = [int(rv) for _, _, rv in seen]
    assert versions == sorted(set(versions)) and versions[0] > int(since)

    kube_api.store.compact()
    with pytest.raises(ApiException) as expired:
        list(Watch().stream(coord.list_namespaced_lease, NS, resource_version=since, timeout_seconds=1))
    assert expired.value.status == 410


def test_a_stale_replace_is_a_conflict_and_errors_are_status_bodies(kube_api, api):
    coord, batch = client.CoordinationV1Api(api), client.BatchV1Api(api)
    coord.create_namespaced_lease(
        NS, client.V1Lease(metadata=client.V1ObjectMeta(name="l"), spec=client.V1LeaseSpec(holder_identity="a"))
    )
    stale = coord.read_namespaced_lease("l", NS)
    coord.patch_namespaced_lease("l", NS, {"spec": {"holderIdentity": "b"}})
    stale.spec.holder_identity = "c"
    cases = [
        (lambda: coord.replace_namespaced_lease("l", NS, stale), 409, "Conflict"),
        (
            lambda: coord.create_namespaced_lease(NS, client.V1Lease(metadata=client.V1ObjectMeta(name="l"))),
            409,
            "AlreadyExists",
        ),
        (lambda: coord.read_namespaced_lease("nope", NS), 404, "NotFound"),
        (lambda: batch.create_namespaced_job(NS, job("Bad_Name", SLEEP)), 422, "Invalid"),
        (lambda: client.CoreV1Api(api).read_namespace("missing"), 404, "NotFound"),
        (
            lambda: batch.patch_namespaced_job("j", NS, {"spec": {"template": {"spec": {"subdomain": "x"}}}}),
            422,
            "Invalid",
        ),
        (lambda: client.CoreV1Api(api).patch_namespaced_pod("lone", NS, {"spec": {"hostname": "x"}}), 422, "Invalid"),
    ]
    batch.create_namespaced_job(NS, job("j", SLEEP, nodes=1, suspend=True))
    client.CoreV1Api(api).create_namespaced_pod(NS, bare_pod("lone", SLEEP))
    for call, code, reason in cases:
        with pytest.raises(ApiException) as err:
            call()
        body = json.loads(err.value.body)
        assert (err.value.status, body["kind"], body["reason"], body["code"]) == (code, "Status", reason, code)
    assert coord.read_namespaced_lease("l", NS).spec.holder_identity == "b"


def test_self_subject_access_review_answers_from_the_allow_list(tmp_path):
    with KubeAPI(tmp_path, allow={("create", "batch", "jobs"), ("get", "", "pods/log")}) as fake:
        auth = client.AuthorizationV1Api(fake.client())

        def can(verb, group, resource, sub=None):
            review = client.V1SelfSubjectAccessReview(
                spec=client.V1SelfSubjectAccessReviewSpec(
                    resource_attributes=client.V1ResourceAttributes(
                        namespace=NS, verb=verb, group=group, resource=resource, subresource=sub
                    )
                )
            )
            return auth.create_self_subject_access_review(review).status.allowed

        assert [can("create", "batch", "jobs"), can("get", "", "pods", "log"), can("delete", "batch", "jobs")] == [
            True,
            True,
            False,
        ]


def test_no_pod_process_outlives_the_double_and_a_wrong_token_is_refused(tmp_path):
    with KubeAPI(tmp_path) as fake:
        core = client.CoreV1Api(fake.client())
        core.create_namespaced_pod(
            NS,
            client.V1Pod(
                metadata=client.V1ObjectMeta(name="lone"),
                spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="x:1", command=SLEEP)]),
            ),
        )
        wait_for(lambda: core.read_namespaced_pod("lone", NS).status.phase == "Running", 30, "the pod running")
        pids = list(fake.runner.pids)
        fake.token = "rotated"
        with pytest.raises(ApiException) as denied:
            core.read_namespaced_pod("lone", NS)
        assert denied.value.status == 401
    assert pids and not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize(
    "selector, labels, expected",
    [
        ("app=pretrain,run=r1", {"app": "pretrain", "run": "r1"}, True),
        ("app==pretrain", {"app": "other"}, False),
        ("stage!=main", {}, True),
        ("stage in (warmup, main),app", {"stage": "main", "app": "x"}, True),
        ("stage notin (main)", {"stage": "main"}, False),
        ("!attempt", {"attempt": "1"}, False),
        ("", {"any": "thing"}, True),
    ],
)
def test_label_selectors(selector, labels, expected):
    assert label_matcher(selector)(labels) is expected
