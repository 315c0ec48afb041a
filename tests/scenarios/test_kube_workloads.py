"""The Kubernetes API test double's Job controller and pod runner, driven through the unmodified
official ``kubernetes`` client: Indexed Jobs and their pods (DNS names, deletion, TTL, replacement,
backoff, parallelism, pod failure policy), scripted pod faults, environment and logs."""

from __future__ import annotations

import psutil
import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.watch import Watch

from support import kube_api as double
from support import kube_client_bodies as bodies
from support.campaigns import wait_for
from support.kube_client_bodies import NS, SLEEP, bare_pod, job
from support.kube_jobs import policy_action, ranges
from support.kube_pods import expand
from support.s3_servers import free_ports

kube_api, api = double.kube_api, bodies.api  # the fixtures

# pod 0 echoes one line on its own DNS name; pod 1 connects to it by that name and prints the answer
ECHO = """
import socket, sys, time
index, host, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
if index == 0:
    with socket.create_server((host, port)) as server:
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"echo: " + conn.recv(100))
else:
    deadline = time.monotonic() + 30
    while True:  # the peer may not listen yet: retry with a deadline, as a rendezvous client does
        try:
            conn = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    with conn:
        conn.sendall(b"ping from %d" % index)
        print(conn.recv(100).decode(), flush=True)
"""


def headless_service() -> client.V1Service:
    return client.V1Service(
        metadata=client.V1ObjectMeta(name="train"),
        spec=client.V1ServiceSpec(
            cluster_ip="None",
            publish_not_ready_addresses=True,
            selector={"app": "pretrain"},
            ports=[client.V1ServicePort(name="rdzv", port=29500)],
        ),
    )


def pods_of(core: client.CoreV1Api, name: str) -> list[client.V1Pod]:
    return core.list_namespaced_pod(NS, label_selector=f"run={name}").items


def job_condition(batch: client.BatchV1Api, name: str) -> str | None:
    status = batch.read_namespaced_job_status(name, NS).status
    return next(
        (c.type for c in status.conditions or [] if c.type in ("Complete", "Failed") and c.status == "True"), None
    )


def test_indexed_job_pods_reach_each_other_by_dns_name_and_complete(kube_api, api):
    core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
    core.create_namespaced_service(NS, headless_service())
    port = free_ports(1)[0]
    batch.create_namespaced_job(
        NS,
        job(
            "echo",
            ["python", "-c", ECHO, "$(JOB_COMPLETION_INDEX)", "echo-0.train.default.svc.cluster.local", str(port)],
        ),
    )
    assert wait_for(lambda: job_condition(batch, "echo"), 60, "the job to finish") == "Complete"
    pods = sorted(pods_of(core, "echo"), key=lambda p: p.metadata.name)
    assert [p.status.phase for p in pods] == ["Succeeded", "Succeeded"]
    assert [p.spec.hostname for p in pods] == ["echo-0", "echo-1"]
    assert all(p.metadata.name.startswith(f"echo-{i}-") for i, p in enumerate(pods))
    assert all(p.status.container_statuses[0].state.terminated.exit_code == 0 for p in pods)
    assert pods[0].status.pod_ip != pods[1].status.pod_ip
    assert core.read_namespaced_pod_log(pods[1].metadata.name, NS).strip() == "echo: ping from 1"
    status = batch.read_namespaced_job("echo", NS).status
    assert (status.succeeded, status.failed, status.active, status.completed_indexes) == (2, 0, 0, "0-1")


def test_foreground_delete_of_a_job_leaves_no_object_and_no_process(kube_api, api):
    core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
    created = batch.create_namespaced_job(NS, job("sleepy", SLEEP))
    owner = client.V1OwnerReference(api_version="batch/v1", kind="Job", name="sleepy", uid=created.metadata.uid)
    service = headless_service()
    service.metadata.owner_references = [owner]
    core.create_namespaced_service(NS, service)
    wait_for(lambda: [p.status.phase for p in pods_of(core, "sleepy")] == ["Running"] * 2, 30, "two running pods")
    pids = list(kube_api.runner.pids)
    deleting = batch.delete_namespaced_job("sleepy", NS, propagation_policy="Foreground")
    assert deleting["metadata"]["finalizers"] == ["foregroundDeletion"]  # it stays until its pods are gone
    wait_for(lambda: not batch.list_namespaced_job(NS).items, 30, "the job gone")
    assert not pods_of(core, "sleepy") and not core.list_namespaced_service(NS).items
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def test_a_finished_job_goes_after_its_ttl_with_its_pods(kube_api, api):
    core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
    batch.create_namespaced_job(NS, job("brief", ["python", "-c", "pass"], nodes=1, ttl_seconds_after_finished=0))
    wait_for(lambda: not batch.list_namespaced_job(NS).items, 30, "the finished job gone")
    wait_for(lambda: not pods_of(core, "brief"), 30, "its pod gone")
    assert kube_api.runner.pids  # it did run


def test_a_job_deleted_without_a_policy_orphans_its_pods_as_the_real_api_does(kube_api, api):
    core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
    batch.create_namespaced_job(NS, job("orphans", SLEEP, nodes=1))
    wait_for(lambda: pods_of(core, "orphans"), 30, "the pod")
    batch.delete_namespaced_job("orphans", NS)
    wait_for(lambda: not batch.list_namespaced_job(NS).items, 30, "the job gone")
    (pod,) = pods_of(core, "orphans")
    assert not pod.metadata.owner_references
    assert core.delete_namespaced_pod(pod.metadata.name, NS).metadata.deletion_timestamp is not None
    wait_for(lambda: not pods_of(core, "orphans"), 30, "the pod gone")


def test_a_deleted_pod_is_replaced_for_its_index_and_an_oom_kill_then_exhausts_the_backoff_limit(kube_api, api):
    core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
    batch.create_namespaced_job(NS, job("replace", SLEEP, backoff_limit=1))
    wait_for(lambda: [p.status.phase for p in pods_of(core, "replace")] == ["Running"] * 2, 30, "two running pods")
    since = core.list_namespaced_pod(NS).metadata.resource_version
    index = "batch.kubernetes.io/job-completion-index"
    lost = core.list_namespaced_pod(NS, label_selector=f"{index}=1").items[0].metadata.name
    core.delete_namespaced_pod(lost, NS, grace_period_seconds=0)  # a node lost, say
    (new,) = wait_for(
        lambda: [
            p
            for p in core.list_namespaced_pod(NS, label_selector=f"{index}=1").items
            if p.metadata.name != lost and p.status.phase == "Running"
        ],
        30,
        "a new pod for index 1",
    )
    assert (batch.read_namespaced_job("replace", NS).status.failed, new.spec.hostname) == (1, "replace-1")
    events = [
        (e["type"], e["object"].metadata.name)
        for e in Watch().stream(
            core.list_namespaced_pod, NS, label_selector="run=replace", resource_version=since, timeout_seconds=1
        )
    ]
    assert events.count(("DELETED", lost)) == 1 and events.count(("ADDED", new.metadata.name)) == 1
    *listed, bookmark = list(
        Watch().stream(  # no version: the current pods first; a BOOKMARK at the end
            core.list_namespaced_pod, NS, label_selector="run=replace", timeout_seconds=1, allow_watch_bookmarks=True
        )
    )
    names = [e["object"].metadata.name for e in listed]
    assert {e["type"] for e in listed} == {"ADDED"} and lost not in names and new.metadata.name in names
    assert bookmark["type"] == "BOOKMARK" and isinstance(bookmark["object"]["metadata"]["resourceVersion"], str)

    first = core.list_namespaced_pod(NS, label_selector=f"{index}=0").items[0].metadata.name
    kube_api.runner.oom_kill(NS, first)
    assert wait_for(lambda: job_condition(batch, "replace"), 30, "the job to fail") == "Failed"
    terminated = core.read_namespaced_pod(first, NS).status.container_statuses[0].state.terminated
    assert (terminated.reason, terminated.exit_code) == ("OOMKilled", 137)
    conditions = {c.type: c.reason for c in batch.read_namespaced_job("replace", NS).status.conditions}
    assert conditions["Failed"] == "BackoffLimitExceeded"
    wait_for(lambda: all(p.status.phase == "Failed" for p in pods_of(core, "replace")), 30, "the other pod stopped")


SECRET_ENV = [
    client.V1EnvVar(
        name="TOKEN",
        value_from=client.V1EnvVarSource(secret_key_ref=client.V1SecretKeySelector(name="mlflow", key="token")),
    )
]
GPU = client.V1ResourceRequirements(limits={"nvidia.com/gpu": "1"})


@pytest.mark.parametrize(
    "fault, container, waiting, scheduled",
    [
        (
            "unpullable",
            {"image": "registry.example/missing:1"},
            ("ImagePullBackOff", "registry.example/missing:1"),
            "True",
        ),
        ("no secret", {"env": SECRET_ENV}, ("CreateContainerConfigError", "Secret default/mlflow"), "True"),
        ("no gpu", {"resources": GPU}, None, "False"),
    ],
    ids=["unpullable", "no secret", "no gpu"],
)
def test_a_scripted_fault_leaves_the_pod_pending_with_its_reason(kube_api, api, fault, container, waiting, scheduled):
    core = client.CoreV1Api(api)
    kube_api.runner.unpullable.add("registry.example/missing:1")
    kube_api.runner.unschedulable.add("nvidia.com/gpu")
    core.create_namespaced_pod(NS, bare_pod("p", SLEEP, **container))

    def settled():
        status = core.read_namespaced_pod("p", NS).status
        statuses = status.container_statuses or []
        if waiting and statuses and statuses[0].state.waiting and statuses[0].state.waiting.reason == waiting[0]:
            return status
        if not waiting and any(
            c.type == "PodScheduled" and c.reason == "Unschedulable" for c in status.conditions or []
        ):
            return status

    status = wait_for(settled, 30, fault)
    assert status.phase == "Pending" and kube_api.runner.pids == []
    with pytest.raises(ApiException) as no_logs:
        core.read_namespaced_pod_log("p", NS)
    assert no_logs.value.status == 400
    assert {c.type: c.status for c in status.conditions}["PodScheduled"] == scheduled
    if waiting:
        assert waiting[1] in status.container_statuses[0].state.waiting.message
    else:
        assert "Insufficient nvidia.com/gpu" in next(c.message for c in status.conditions if c.type == "PodScheduled")


def test_the_process_gets_secrets_fields_and_expanded_args_and_its_logs_are_served(kube_api, api):
    core = client.CoreV1Api(api)
    kube_api.runner.secrets[(NS, "mlflow")] = {"token": "s3cr3t"}
    env = [
        *SECRET_ENV,
        client.V1EnvVar(
            name="ME",
            value_from=client.V1EnvVarSource(field_ref=client.V1ObjectFieldSelector(field_path="metadata.name")),
        ),
        client.V1EnvVar(name="GREETING", value="hi $(ME)"),
    ]
    script = (
        "import os, sys; print('first'); "
        "print(os.environ['TOKEN'], os.environ['GREETING'], sys.argv[1], os.environ['HOSTNAME'])"
    )
    core.create_namespaced_pod(NS, bare_pod("talker", ["python", "-c", script, "$(ME)-$$(ME)"], env=env))
    wait_for(lambda: core.read_namespaced_pod("talker", NS).status.phase == "Succeeded", 30, "the pod to finish")
    assert core.read_namespaced_pod_log("talker", NS, tail_lines=1) == "s3cr3t hi talker talker-$(ME) talker\n"
    assert core.read_namespaced_pod_log("talker", NS).startswith("first\n")
    assert core.read_namespaced_pod("talker", NS).spec.node_name == kube_api.runner.node_name


def test_parallelism_patched_down_stops_the_highest_index_without_counting_a_failure(kube_api, api):
    core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
    batch.create_namespaced_job(NS, job("elastic", SLEEP, nodes=3))
    wait_for(lambda: [p.status.phase for p in pods_of(core, "elastic")] == ["Running"] * 3, 30, "three running pods")
    batch.patch_namespaced_job("elastic", NS, {"spec": {"parallelism": 2}})
    wait_for(lambda: len(pods_of(core, "elastic")) == 2, 30, "one pod stopped")
    assert sorted(p.spec.hostname for p in pods_of(core, "elastic")) == ["elastic-0", "elastic-1"]
    status = batch.read_namespaced_job("elastic", NS).status
    assert (status.active, status.failed, status.conditions) == (2, 0, [])


def test_pod_failure_policy_ignores_an_eviction_and_fails_the_job_on_a_config_exit_code(kube_api, api):
    core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
    exit_3 = client.V1PodFailurePolicyOnExitCodesRequirement(operator="In", values=[3])
    disrupted = client.V1PodFailurePolicyOnPodConditionsPattern(type="DisruptionTarget", status="True")
    policy = client.V1PodFailurePolicy(
        rules=[
            client.V1PodFailurePolicyRule(action="FailJob", on_exit_codes=exit_3),
            client.V1PodFailurePolicyRule(action="Ignore", on_pod_conditions=[disrupted]),
        ]
    )
    script = "import os, sys, time\nwhile not os.path.exists('fail'): time.sleep(0.05)\nsys.exit(3)"
    batch.create_namespaced_job(NS, job("policy", ["python", "-c", script], nodes=1, pod_failure_policy=policy))
    (first,) = wait_for(
        lambda: [p for p in pods_of(core, "policy") if p.status.phase == "Running"], 30, "a running pod"
    )
    eviction = client.V1Eviction(metadata=client.V1ObjectMeta(name=first.metadata.name))
    core.create_namespaced_pod_eviction(first.metadata.name, NS, eviction)
    (second,) = wait_for(
        lambda: [
            p for p in pods_of(core, "policy") if p.metadata.name != first.metadata.name and p.status.phase == "Running"
        ],
        30,
        "a replacement pod",
    )
    assert batch.read_namespaced_job("policy", NS).status.failed == 0  # the eviction did not count
    (kube_api.runner.workdir / NS / "fail").touch()  # in the pods' working directory: exit 3
    assert wait_for(lambda: job_condition(batch, "policy"), 30, "the job to fail") == "Failed"
    (failed,) = [c for c in batch.read_namespaced_job("policy", NS).status.conditions if c.type == "Failed"]
    assert failed.reason == "PodFailurePolicy"
    assert batch.read_namespaced_job("policy", NS).status.active == 0


@pytest.mark.parametrize(
    "text, env, expected",
    [
        ("$(A)-$(B)", {"A": "1"}, "1-$(B)"),
        ("$$(A) $$", {"A": "1"}, "$(A) $"),
    ],
)
def test_kubelet_variable_expansion(text, env, expected):
    assert expand(text, env) == expected


@pytest.mark.parametrize("indexes, expected", [(set(), ""), ({0}, "0"), ({0, 1, 2, 5, 7, 8}, "0-2,5,7-8")])
def test_index_ranges(indexes, expected):
    assert ranges(indexes) == expected


@pytest.mark.parametrize(
    "exit_code, conditions, expected",
    [
        (3, [], "FailJob"),
        (137, [], "Count"),
        (143, [{"type": "DisruptionTarget", "status": "True"}], "Ignore"),
        (0, [{"type": "DisruptionTarget", "status": "False"}], "Count"),
    ],
)
def test_pod_failure_policy_rules(exit_code, conditions, expected):
    rules = [
        {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [3]}},
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]
    pod = {
        "status": {
            "conditions": conditions,
            "containerStatuses": [{"name": "node", "state": {"terminated": {"exitCode": exit_code}}}],
        }
    }
    assert policy_action(rules, pod)[0] == expected
