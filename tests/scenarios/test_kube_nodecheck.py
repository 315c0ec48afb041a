"""The node check on Kubernetes through the API test double: ``trainer.nodecheck`` in pods of
the training pods' shape, rows read from the shared workdir, judged as the local cluster's, and
the Kubernetes nodes of excluded indices kept out of the next launch (required node affinity)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_kube_cluster import NS, kube_spec, launch, live_pids, objects
from test_kube_manifests import assert_valid, k8s_spec

from pretrain.cluster.kube.cluster import KubeCluster
from pretrain.cluster.kube.manifests import stage_launch
from pretrain.cluster.kube.nodecheck import HOSTS, HostMemory, check_launch, checks_dir
from support import kube_api as double
from trainer.resilience.nodecheck import judge_nodes

kube_api = double.kube_api  # the fixture
HOST = "kube-double-node"  # the double's one Kubernetes node


def test_the_node_check_runs_in_pods_judges_a_slow_node_and_keeps_the_next_launch_off_its_host(
    kube_api, prepared_data, tmp_path
):
    spec = kube_spec(tmp_path / "w", steps=400)
    cluster = KubeCluster(spec, kube_api.client(), unschedulable_after_s=5.0)
    rows = cluster.health_check(spec.workdir_path, delays={1: 0.05})  # chaos: node 1 burns 50 ms per matmul
    assert [(r["node"], r["local_rank"], r["ok"], r["host"]) for r in rows] == [
        (0, 0, True, HOST),
        (1, 0, True, HOST),
    ], rows
    assert all(r["allreduce_MBps"] > 0 for r in rows)  # the two pods met through the Service's DNS name of pod 0
    _, excluded = judge_nodes(rows, spec.fault_tolerance.node_check_threshold)
    assert excluded == {1}
    assert objects(kube_api) == {"jobs": [], "pods": [], "services": []} and live_pids(kube_api) == []
    assert HostMemory(checks_dir(spec.workdir_path) / HOSTS).read() == {0: HOST, 1: HOST}

    cluster, job, path = launch(kube_api, spec, prepared_data)
    handle = cluster.start(job, path, spec.layout, exclude=excluded)
    try:
        pod = kube_api.store.get("jobs", NS, handle.name)["spec"]["template"]["spec"]
        term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
        assert term["matchFields"] == [{"key": "metadata.name", "operator": "NotIn", "values": [HOST]}]
        assert any(HOST in n and "failed the node check" in n for n in handle.notices), handle.notices
    finally:
        handle.stop(grace_s=1)


def test_a_node_check_whose_image_cannot_be_pulled_fails_at_once_saying_what_to_fix(kube_api, tmp_path):
    spec = kube_spec(tmp_path / "w", image="registry.example/pretrain:typo")
    kube_api.runner.unpullable.add("registry.example/pretrain:typo")
    rows = KubeCluster(spec, kube_api.client(), unschedulable_after_s=60.0).health_check(spec.workdir_path)
    assert [r["ok"] for r in rows] == [False, False]
    assert any("ImagePullBackOff" in r["error"] or "ErrImagePull" in r["error"] for r in rows), rows
    assert all("cluster.kubernetes.image" in r["error"] or "no result" in r["error"] for r in rows), rows
    assert objects(kube_api) == {"jobs": [], "pods": [], "services": []}


def test_the_node_check_manifests_are_valid_and_shaped_like_the_training_pods():
    spec = k8s_spec(nodes=3)
    wpn = spec.cluster.workers_per_node
    check = check_launch(spec, [0, 2], {2 * wpn: 0.5}, check_id="abc123")  # node 2's first slot is slow
    service, job = check.manifests()
    assert_valid([service, job])
    train = stage_launch(spec, spec.stages[0].name).job_manifest()["spec"]["template"]["spec"]
    pod = job["spec"]["template"]["spec"]
    same = ("image", "resources", "volumeMounts", "env", "imagePullPolicy")
    assert {k: pod["containers"][0][k] for k in same} == {k: train["containers"][0][k] for k in same}
    for key in (
        "volumes",
        "serviceAccountName",
        "tolerations",
        "nodeSelector",
        "priorityClassName",
        "imagePullSecrets",
    ):
        assert pod[key] == train[key], key
    assert job["spec"]["completions"] == 2 and pod["subdomain"] == service["metadata"]["name"] == check.name
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in service["spec"]["selector"].items())
    assert "pretrain.io/stage" not in service["spec"]["selector"]  # never selects a training launch's pods
    script = pod["containers"][0]["command"][2]
    assert "1) python -m trainer.nodecheck" in script and f"--rank {wpn} --world {2 * wpn}" in script
    assert f"--extra-delay 0.5 --out {spec.workdir_path}/node-checks/abc123/node2-0.json" in script
    assert script.count("--extra-delay 0.5") == 1
    assert f"--master-addr {check.name}-0.{check.name}.train.svc" in script


def test_a_launch_avoiding_hosts_validates_on_the_oldest_and_newest_kubernetes():
    spec = k8s_spec()
    base = stage_launch(spec, spec.stages[0].name)
    assert_valid(replace(base, avoid_hosts=("gpu-7", "gpu-3")).manifests())
    assert "affinity" not in base.job_manifest()["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    "content, hosts, notice",
    [
        (None, (), "is not recorded"),
        ('{"hosts": {"0": "a", "1": "b"}}', ("b",), "kept off Kubernetes node(s) ['b']"),
        ('{"hosts": {"0": "a"}', (), "unreadable (JSONDecodeError)"),
        ('["a", "b"]', (), "unreadable"),
        ('{"hosts": {"x": "b"}}', (), "unreadable (ValueError)"),
    ],
)
def test_the_remembered_hosts_of_excluded_nodes(tmp_path, content, hosts, notice):
    path = tmp_path / HOSTS
    if content is not None:
        path.write_text(content)
    found, notices = HostMemory(path).avoid({1})
    assert found == hosts and any(notice in n for n in notices), notices


def test_each_slot_s_row_says_why_it_has_no_result(tmp_path):
    """Rows from the check's files and pods: a damaged result file, a failed pod with its log,
    a configuration error, a pod still running at the timeout, a pod never created."""
    from pretrain.cluster.kube.nodecheck import result_rows
    from pretrain.cluster.kube.pods import PodVerdict

    spec = kube_spec(tmp_path / "w")
    check = check_launch(spec, [0, 1, 2, 3, 4], None, check_id="t")  # one worker slot per node
    out = tmp_path / "w" / "node-checks" / "t"
    out.mkdir(parents=True)
    (out / "node0-0.json").write_text('{"matmul_s": 0.01, "rank": 0}')
    (out / "node1-0.json").write_text('{"matmul_s": 0.0')  # torn
    verdicts = {
        0: PodVerdict("p0", 0, "succeeded", host="n-a"),
        1: PodVerdict("p1", 1, "succeeded", host="n-b"),
        2: PodVerdict("p2", 2, "failed", "worker_failure", 1, "pod p2 exited with code 1", host="n-c"),
        3: PodVerdict("p3", 3, "failed", "kube_config", 78, "pod p3: ErrImagePull: … check cluster.kubernetes.image"),
        4: PodVerdict("p4", 4, "running", host="n-d"),
    }
    rows = result_rows(check, verdicts, {2: "Traceback …\nRuntimeError: gloo timed out\n"}, 42.0)
    assert [(r["node"], r["ok"], r["host"]) for r in rows] == [
        (0, True, "n-a"),
        (1, False, "n-b"),
        (2, False, "n-c"),
        (3, False, None),
        (4, False, "n-d"),
    ]
    errors = {r["node"]: r.get("error", "") for r in rows}
    assert rows[0]["matmul_s"] == 0.01
    assert f"{out}/node1-0.json is unreadable (JSONDecodeError)" in errors[1]
    assert errors[2].startswith("pod p2 exited with code 1; log: ") and "gloo timed out" in errors[2]
    assert errors[3].endswith("check cluster.kubernetes.image")  # what to fix, without a log that has nothing
    assert errors[4] == "no result in 42s (pod p4 is running)"
    assert "never created in 0s" in result_rows(check_launch(spec, [7], None, check_id="t"), {}, {}, 0.0)[0]["error"]
    unshared = result_rows(check_launch(spec, [7], None, check_id="t"), {0: PodVerdict("p7", 0, "succeeded")}, {}, 1.0)
    assert "workdir must be the same volume" in unshared[0]["error"] and "workdir_claim" in unshared[0]["error"]
