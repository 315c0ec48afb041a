"""A pod's status → what it means for the training job (``pretrain.cluster.kube.pods``), table-driven."""

from __future__ import annotations

import pytest

from pretrain.cluster.kube.pods import CONFIG_EXIT, LOST_EXIT, frozen, pod_verdict, probe_stopped

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z
T0 = "2027-01-15T08:00:00Z"


def pod(phase="Running", *, terminated=None, waiting=None, conditions=(), deleting=False, reason=None, index="1"):
    state = {"terminated": terminated} if terminated else {"waiting": waiting} if waiting else {"running": {}}
    meta = {"name": "pt-x-1-abcde", "annotations": {"batch.kubernetes.io/job-completion-index": index}}
    if deleting:
        meta["deletionTimestamp"] = T0
    status = {
        "phase": phase,
        "conditions": list(conditions),
        "containerStatuses": [
            {"name": "node", "image": "i", "imageID": "", "ready": False, "restartCount": 0, "state": state}
        ],
    }
    if reason:
        status["reason"] = reason
    return {"metadata": meta, "status": status}


def cond(type_, status="True", reason="", at=T0):
    return {"type": type_, "status": status, "reason": reason, "message": f"{reason} message", "lastTransitionTime": at}


CASES = [
    # (pod, deleted, state, cause, exit code, words in the message)
    (pod(), False, "running", None, None, ""),
    (pod("Pending", waiting={"reason": "ContainerCreating"}), False, "pending", None, None, ""),
    (pod("Succeeded", terminated={"exitCode": 0, "reason": "Completed"}), False, "succeeded", None, None, ""),
    (
        pod("Failed", terminated={"exitCode": 1, "reason": "Error"}),
        False,
        "failed",
        "worker_failure",
        1,
        "exited with code 1",
    ),
    (
        pod("Failed", terminated={"exitCode": 137, "reason": "OOMKilled"}),
        False,
        "failed",
        "oom",
        137,
        "memory_per_node",
    ),
    (
        pod(
            "Failed",
            terminated={"exitCode": 143, "reason": "Error"},
            conditions=[cond("DisruptionTarget", reason="EvictionByEvictionAPI")],
        ),
        False,
        "failed",
        "node_lost",
        143,
        "evicted",
    ),
    (
        pod(conditions=[cond("DisruptionTarget", reason="PreemptionByScheduler")]),
        False,
        "failed",
        "node_lost",
        LOST_EXIT,
        "preempted",
    ),
    (
        pod(conditions=[cond("DisruptionTarget", reason="DeletionByTaintManager")]),
        False,
        "failed",
        "node_lost",
        LOST_EXIT,
        "node not ready",
    ),
    (pod("Failed", reason="Evicted"), False, "failed", "node_lost", LOST_EXIT, "Evicted"),
    (pod(deleting=True), False, "failed", "node_lost", LOST_EXIT, "deleted"),
    (pod(), True, "failed", "node_lost", LOST_EXIT, "deleted"),  # gone from the API while running
    (
        pod("Failed", terminated={"exitCode": 2, "reason": "Error"}),
        False,
        "failed",
        "kube_config",
        2,
        "image must contain",
    ),
    (
        pod("Pending", waiting={"reason": "ImagePullBackOff", "message": 'Back-off pulling image "x"'}),
        False,
        "failed",
        "kube_config",
        CONFIG_EXIT,
        "image_pull_secrets",
    ),
    (
        pod("Pending", waiting={"reason": "ErrImagePull", "message": "not found"}),
        False,
        "failed",
        "kube_config",
        CONFIG_EXIT,
        "cluster.kubernetes.image",
    ),
    (
        pod("Pending", waiting={"reason": "CreateContainerConfigError", "message": "couldn't find key k in Secret s"}),
        False,
        "failed",
        "kube_config",
        CONFIG_EXIT,
        "secret_env",
    ),
    (
        pod("Pending", conditions=[cond("PodScheduled", "False", "Unschedulable", at="2027-01-15T07:59:00Z")]),
        False,
        "failed",
        "kube_config",
        CONFIG_EXIT,
        "no node fits",
    ),  # 60 s ≥ the 30 s allowed
    (
        pod("Pending", conditions=[cond("PodScheduled", "False", "Unschedulable", at="2027-01-15T07:59:50Z")]),
        False,
        "pending",
        None,
        None,
        "",
    ),  # 10 s: the cluster may still scale up
]


@pytest.mark.parametrize("obj, deleted, state, cause, code, words", CASES)
def test_pod_verdicts(obj, deleted, state, cause, code, words):
    v = pod_verdict(obj, NOW, unschedulable_after_s=30, deleted=deleted)
    assert (v.state, v.cause, v.exit_code, v.index) == (state, cause, code, 1)
    assert words in v.message
    assert v.fatal == (cause == "kube_config")


def test_a_pod_without_status_or_index_is_pending_and_nodeless():
    v = pod_verdict({"metadata": {"name": "p"}}, NOW, 30)
    assert (v.state, v.index) == ("pending", None)


KILLED = {"exitCode": 137, "reason": "Error", "finishedAt": "2027-01-15T08:00:40Z"}  # 40 s after NOW


@pytest.mark.parametrize(
    "terminated, last_sign, limit, silent",
    [
        (KILLED, NOW, 30, 40.0),  # silent 40 s when SIGKILLed, the probe's limit 30 s: the probe stopped a frozen agent
        (KILLED, NOW + 10, 30, 30.0),  # exactly at the limit
        (KILLED, NOW + 10.5, 30, 29.5),  # finishedAt is whole seconds: half a second short still counts
        (KILLED, NOW + 20, 30, None),  # still giving signs of life 20 s before: SIGKILLed for another reason
        (KILLED, None, 30, None),  # no liveness file: nothing to judge by
        (KILLED, NOW, 0, None),  # no probe in the pods
        ({**KILLED, "exitCode": 1}, NOW, 30, None),  # an exit of its own, however quiet before
        ({**KILLED, "reason": "OOMKilled"}, NOW, 30, None),  # the kernel's OOM killer, not the probe
    ],
    ids=["frozen", "at-limit", "rounding", "alive", "no-file", "no-probe", "own-exit", "oom"],
)
def test_a_container_killed_after_its_agent_fell_silent_was_stopped_by_its_liveness_probe(
    terminated, last_sign, limit, silent
):
    obj = pod("Failed", terminated=terminated)
    v = pod_verdict(obj, NOW + 60, unschedulable_after_s=30)
    assert probe_stopped(v, obj, last_sign, limit) == silent
    if silent is not None:
        lost = frozen(v, silent)
        assert (lost.cause, lost.exit_code, lost.index, lost.fatal) == ("node_lost", 137, 1, False)
        assert "liveness probe" in lost.message and "frozen" in lost.message
