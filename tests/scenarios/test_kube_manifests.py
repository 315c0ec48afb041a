"""Kubernetes manifests of a stage launch: valid for the oldest and newest supported Kubernetes,
secrets by reference only, DNS-safe names, /dev/shm sized from the model, and `pretrain cluster render`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from kubernetes_validate import validate
from typer.testing import CliRunner

from pretrain.cli.app import app
from pretrain.cluster.factory import make_cluster
from pretrain.cluster.kube.manifests import (
    CONFIG_EXIT_CODES,
    NEWEST_K8S,
    OLDEST_K8S,
    label_value,
    node_shm_bytes,
    object_name,
    stage_launch,
)
from pretrain.cluster.local import ClusterError
from pretrain.spec.campaign import SpecError, parse_spec
from pretrain.spec.kube import quantity_bytes
from trainer.liveness import NodeLiveness, liveness_path

ROOT = Path(__file__).resolve().parents[2]
SECRET = "s3cr3t-value-never-rendered"
KUBE = {
    "image": "ghcr.io/o/pretrain:1",
    "namespace": "train",
    "image_pull_secrets": ["regcred"],
    "service_account_name": "pretrain-trainer",
    "gpus_per_node": 2,
    "priority_class_name": "training",
    "node_selector": {"gpu": "h100"},
    "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "secret_env": {
        "AWS_SECRET_ACCESS_KEY": {"secret": "s3-creds", "key": "secret-key"},
        "MLFLOW_TRACKING_TOKEN": {"secret": "mlflow", "key": "token"},
    },
    "env": {"AWS_DEFAULT_REGION": "eu-west-1"},
    "workdir_claim": "campaigns",
    "labels": {"team": "llm"},
    "annotations": {"owner": "llm-team@example.com"},
}


def k8s_spec(name: str = "Demo_Campaign", nodes: int = 3, top: dict | None = None, spare_nodes: int = 0, **kube):
    return parse_spec(
        {
            **(top or {}),
            "name": name,
            "tracking": {"uri": "http://mlflow.train.svc:5000"},
            "cluster": {
                "kind": "kubernetes",
                "nodes_min": 2,
                "nodes_max": nodes,
                "spare_nodes": spare_nodes,
                "kubernetes": {**KUBE, **kube},
            },
        }
    )


def assert_valid(docs: list[dict]) -> None:
    for version in (OLDEST_K8S, NEWEST_K8S):
        for doc in docs:
            validate(doc, version, strict=True)  # raises ValidationError naming the field


def test_manifests_validate_on_the_oldest_and_newest_kubernetes():
    spec = k8s_spec()
    for stage in spec.stages:
        assert_valid(stage_launch(spec, stage.name, attempt=2).manifests())


def test_a_stage_is_a_headless_service_and_an_indexed_job_of_one_pod_per_node():
    launch = stage_launch(k8s_spec(nodes=3), "main", attempt=1)
    service, job = launch.manifests()
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels[k] == v for k, v in service["spec"]["selector"].items())  # the Service selects the pods
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    assert pod["subdomain"] == service["metadata"]["name"] and pod["restartPolicy"] == "Never"
    script = pod["containers"][0]["command"][2]
    name, ns = launch.name, "train"
    assert f"--rdzv-endpoint {name}-0.{name}.{ns}.svc:29400" in script and "trainer.launch" in script
    assert '--node "$JOB_COMPLETION_INDEX"' in script and "--nnodes-min 2 --nnodes-max 3" in script
    limits = pod["containers"][0]["resources"]["limits"]
    assert limits == {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "2"}
    assert pod["nodeSelector"] == {"gpu": "h100"} and pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["tolerations"][0] == {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}
    assert (pod["serviceAccountName"], pod["priorityClassName"]) == ("pretrain-trainer", "training")


def test_node_zero_alone_hosts_the_rendezvous(tmp_path):
    """The container's shell line, run with each completion index, gives --rdzv-host to index 0 only."""
    script = stage_launch(k8s_spec(), "main").command()[2].replace("exec python -m trainer.launch", "echo")
    for index, hosts in (("0", True), ("1", False), ("2", False)):
        out = subprocess.run(
            ["sh", "-c", script],
            env={"JOB_COMPLETION_INDEX": index, "PATH": os.environ["PATH"]},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert f"--node {index}" in out and ("--rdzv-host" in out) is hosts


def test_standby_pods_follow_the_training_pods_and_alone_get_standby(tmp_path):
    """With ``spare_nodes`` the Job has a pod more per standby node, after the training ones: the
    shell line gives --standby to those indices only, the rendezvous keeps nodes_max as its most,
    and every agent unshares its rendezvous store (a standby joining a later round waited for it
    forever, as on a local cluster)."""
    launch = stage_launch(k8s_spec(spare_nodes=1), "main")
    service, job = launch.manifests()
    assert_valid([service, job])
    assert (job["spec"]["completions"], job["spec"]["parallelism"]) == (4, 4)
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"} in container["env"]
    script = container["command"][2].replace("exec python -m trainer.launch", "echo")
    for index, standby in (("0", False), ("2", False), ("3", True)):
        out = subprocess.run(
            ["sh", "-c", script],
            env={"JOB_COMPLETION_INDEX": index, "PATH": os.environ["PATH"]},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert f"--node {index}" in out and "--nnodes-max 3" in out and ("--standby" in out) is standby
    plain = stage_launch(k8s_spec(), "main").job_manifest()["spec"]["template"]["spec"]["containers"][0]
    assert "standby" not in plain["command"][2] and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in str(plain["env"])


@pytest.mark.parametrize(
    "rule, expected",
    [
        (
            0,
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": "node", "operator": "In", "values": CONFIG_EXIT_CODES},
            },
        ),
        (1, {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}),
    ],
)
def test_pod_failure_policy(rule, expected):
    job = stage_launch(k8s_spec(), "main").job_manifest()["spec"]
    assert job["podFailurePolicy"]["rules"][rule] == expected and job["backoffLimitPerIndex"] == 0


def test_secrets_only_by_reference():
    spec = k8s_spec()
    text = yaml.safe_dump_all(stage_launch(spec, "main").manifests())
    env = {e["name"]: e for e in stage_launch(spec, "main").env()}
    assert env["AWS_SECRET_ACCESS_KEY"] == {
        "name": "AWS_SECRET_ACCESS_KEY",
        "valueFrom": {"secretKeyRef": {"name": "s3-creds", "key": "secret-key"}},
    }
    assert env["MLFLOW_TRACKING_URI"]["value"] == "http://mlflow.train.svc:5000"
    assert SECRET not in text and "value: s3" not in text


@pytest.mark.parametrize("env", [{"MY_TOKEN": SECRET}, {"AWS_SECRET_ACCESS_KEY": SECRET}, {"DB_PASSWORD": SECRET}])
def test_a_secret_looking_plain_env_is_refused(env):
    with pytest.raises(SpecError, match="looks like a credential: put it in a Kubernetes Secret"):
        k8s_spec(env=env)


@pytest.mark.parametrize(
    "campaign, stage, attempt",
    [
        ("tiny", "main", 1),
        ("Demo_Campaign", "warmup", 12),
        ("x" * 200, "s" * 100, 3),
        ("a.b_c-d", "_-x-_", 999),
        ("9lives", "9", 1),
    ],
)
def test_names_are_dns_safe_and_distinct(campaign, stage, attempt):
    name = object_name(campaign, stage, attempt)
    assert len(name) <= 52 and name[0].isalpha() and name == name.lower()
    assert all(c.isalnum() or c == "-" for c in name) and not name.endswith("-")
    assert len(f"{name}-{10_000}") <= 63  # pod hostnames <job>-<index>
    assert name != object_name(campaign.upper() + "X", stage, attempt) != object_name(campaign, stage, attempt + 1)


@pytest.mark.parametrize(
    "value, kept",
    [("tiny", True), ("Demo_Campaign.v2", True), ("x" * 64, False), ("_lead", False), ("a b/c", False), ("", True)],
)
def test_label_values(value, kept):
    out = label_value(value)
    assert (out == value) is kept and len(out) <= 63
    assert (
        validate(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "labels": {"k": out}}},
            NEWEST_K8S,
            strict=True,
        )
        is not False
    )


def test_every_object_carries_campaign_stage_and_attempt():
    for doc in stage_launch(k8s_spec(name="Demo_Campaign"), "warmup", attempt=4).manifests():
        for meta in (doc["metadata"], *([doc["spec"]["template"]["metadata"]] if doc["kind"] == "Job" else [])):
            assert {
                "pretrain.io/campaign": "Demo_Campaign",
                "pretrain.io/stage": "warmup",
                "pretrain.io/attempt": "4",
                "team": "llm",
            }.items() <= meta["labels"].items()
            assert meta["annotations"]["owner"] == "llm-team@example.com"


@pytest.mark.parametrize(
    "quantity, size",
    [("16Gi", 16 << 30), ("512Mi", 512 << 20), ("1G", 10**9), ("1024", 1024), ("1.5Gi", 3 << 29), ("500m", 0)],
)
def test_quantities(quantity, size):
    assert quantity_bytes(quantity) == size


@pytest.mark.parametrize(
    "shm, memory, memory_interval, expect",
    [
        ("auto", "16Gi", 5, "fits"),
        ("1Gi", "16Gi", 5, "1024Mi"),
        ("auto", "16Gi", 0, "256Mi"),
        ("auto", "200Mi", 5, "exceeds"),
        ("32Gi", "16Gi", 5, "exceeds"),
        ("1Mi", "16Gi", 5, "too small"),
    ],
)
def test_shm_sizing(shm, memory, memory_interval, expect):
    spec = k8s_spec(shm_size=shm, memory_per_node=memory, top={"checkpoint": {"memory_interval": memory_interval}})
    launch = stage_launch(spec, "main")
    need = node_shm_bytes(launch.job, spec.cluster.workers_per_node, 3)
    if expect == "exceeds":
        with pytest.raises(ValueError, match=rf"/dev/shm needs \d+ MiB .* memory limit .* is {memory}"):
            launch.manifests()
    elif expect == "too small":
        with pytest.raises(ValueError, match=r"shm_size 1Mi \(1 MiB\) is smaller than the \d+ MiB"):
            launch.manifests()
    else:
        volume = launch.job_manifest()["spec"]["template"]["spec"]["volumes"][0]
        assert volume["emptyDir"]["medium"] == "Memory"
        size = quantity_bytes(volume["emptyDir"]["sizeLimit"])
        assert size >= need + (256 << 20 if shm == "auto" else 0) and (
            expect == "fits" or volume["emptyDir"]["sizeLimit"] == expect
        )


def test_shm_grows_with_the_model():
    small = stage_launch(k8s_spec(), "main")
    big_spec = k8s_spec(top={"model": {"d_model": 512, "n_layer": 8}})
    need = [node_shm_bytes(launch.job, 2, 3) for launch in (small, stage_launch(big_spec, "main"))]
    assert need[1] > 10 * need[0]


@pytest.mark.parametrize(
    "cluster, match",
    [
        ({"kind": "kubernetes"}, "kind 'kubernetes' needs a `kubernetes` section"),
        ({"kind": "local", "kubernetes": {"image": "i"}}, "only applies to kind 'kubernetes'"),
        ({"kind": "kubernetes", "kubernetes": {"image": "i", "namespace": "Bad_NS"}}, "namespace"),
        ({"kind": "kubernetes", "kubernetes": {"image": "i", "memory_per_node": "lots"}}, "memory_per_node"),
        ({"kind": "kubernetes", "kubernetes": {"image": "i", "shm_size": "big"}}, "not a Kubernetes quantity"),
    ],
)
def test_spec_rejects(cluster, match):
    with pytest.raises(SpecError, match=match):
        parse_spec({"cluster": cluster})


def test_local_spec_hash_unchanged_and_kubernetes_not_runnable_without_an_api(monkeypatch, tmp_path):
    assert parse_spec({}).spec_hash() == parse_spec({"cluster": {"kind": "local"}}).spec_hash()
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    with pytest.raises(ClusterError, match="no Kubernetes API is configured: set KUBECONFIG.*pretrain cluster render"):
        make_cluster(k8s_spec().cluster)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(ClusterError, match="missing does not exist"):
        make_cluster(k8s_spec().cluster)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pretrain.cli.app", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )


def test_cli_render_prints_valid_yaml(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(k8s_spec().model_dump(mode="json", exclude_defaults=True)))
    done = _cli("cluster", "render", str(path), "--stage", "warmup", "--attempt", "3")
    assert done.returncode == 0, done.stderr
    docs = list(yaml.safe_load_all(done.stdout))
    assert [d["kind"] for d in docs] == ["Service", "Job"] and docs[1]["metadata"]["labels"][
        "pretrain.io/attempt"
    ] == "3"
    assert_valid(docs)


def test_cli_errors_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", "/nonexistent/kubeconfig")  # `run` refuses a kubernetes campaign it cannot reach
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(k8s_spec(memory_per_node="100Mi").model_dump(mode="json", exclude_defaults=True)))
    for args, match in (
        (["cluster", "render", "builtin:tiny"], "cluster.kind is 'local'"),
        (["cluster", "render", str(path), "--stage", "nope"], "no stage 'nope'"),
        (["cluster", "render", str(path)], "/dev/shm needs"),
        (["run", str(path)], "kubeconfig /nonexistent/kubeconfig does not exist: point KUBECONFIG"),
    ):
        done = CliRunner().invoke(app, args)  # in-process: the subprocess path is covered by the render test
        assert done.exit_code == 2, done.output
        assert match in " ".join(done.output.split()) and "Traceback" not in done.output
        assert "kind: Job" not in done.output


def test_the_liveness_probe_fails_only_for_an_agent_silent_too_long(tmp_path):
    """The probe's own command, run as the kubelet would (in the container's environment): a fresh
    liveness file or none yet passes, one older than node_silent_s fails and says why."""
    launch = stage_launch(k8s_spec(top={"workdir": str(tmp_path)}, node_silent_s=20), "main", attempt=1)
    container = launch.job_manifest()["spec"]["template"]["spec"]["containers"][0]
    probe = container["livenessProbe"]
    assert probe["failureThreshold"] == 1 and probe["periodSeconds"] <= 5

    def run_probe(index: int) -> subprocess.CompletedProcess:
        env = {**os.environ, "JOB_COMPLETION_INDEX": str(index), "PYTHONPATH": str(Path(__file__).parents[2])}
        sh, flag, check = probe["exec"]["command"]  # the image's python: this test's
        return subprocess.run(
            [sh, flag, check.replace("exec python ", f"exec {sys.executable} ", 1)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    assert run_probe(1).returncode == 0  # the agent has not written its file yet: starting, not silent
    NodeLiveness(launch.job.job_dir, 1).start().stop()
    assert run_probe(1).returncode == 0
    old = time.time() - 21
    os.utime(liveness_path(launch.job.job_dir, 1), (old, old))
    silent = run_probe(1)
    assert silent.returncode == 1 and "node 1: its agent gave no sign of life for 21s" in silent.stdout
    assert run_probe(0).returncode == 0  # each pod judges its own node
    assert (
        "livenessProbe"
        not in stage_launch(k8s_spec(node_silent_s=0), "main").job_manifest()["spec"]["template"]["spec"]["containers"][
            0
        ]
    )


@pytest.mark.parametrize(
    "own, expected",
    [
        ([], {"node.kubernetes.io/not-ready": 45, "node.kubernetes.io/unreachable": 45}),
        (
            [
                {
                    "key": "node.kubernetes.io/unreachable",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "toleration_seconds": 600,
                }
            ],
            {"node.kubernetes.io/not-ready": 45, "node.kubernetes.io/unreachable": 600},
        ),  # the user's own wins
    ],
)
def test_pods_leave_a_node_that_stopped_reporting_sooner_than_kubernetes_default(own, expected):
    launch = stage_launch(k8s_spec(unreachable_eviction_s=45, tolerations=own), "main")
    tolerations = launch.job_manifest()["spec"]["template"]["spec"]["tolerations"]
    assert {
        t["key"]: t["tolerationSeconds"] for t in tolerations if t.get("key", "").startswith("node.kubernetes.io/")
    } == expected
    assert_valid(launch.manifests())
