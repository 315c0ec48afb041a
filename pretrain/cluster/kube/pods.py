"""What a pod's status means for a training job (pure: camelCase pod dicts in, verdicts out).

Causes are the existing incident causes (``pretrain.run.incidents``): ``oom``, ``node_lost`` (the pod
was deleted, evicted, preempted or its node went away — the node is gone, not the code broken),
``worker_failure`` (a non-zero exit), and ``kube_config``: the pod can never run as specified
(image not pullable, a Secret missing, no node fits it, the agent refused its arguments). A
``kube_config`` verdict fails the job at once and is never retried: relaunching cannot help.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timezone

from pretrain.cluster.kube.manifests import CONFIG_EXIT_CODES

INDEX = "batch.kubernetes.io/job-completion-index"
LOST_EXIT = 137  # a node that vanished without an exit code: as if SIGKILLed
CONFIG_EXIT = 78  # EX_CONFIG: what poll() reports for a configuration error that never ran a process
# waiting reasons that never resolve by themselves → what the user must fix
CONFIG_WAITING = {
    "ErrImagePull": "the image cannot be pulled: check cluster.kubernetes.image (name, tag) and image_pull_secrets",
    "ImagePullBackOff": "the image cannot be pulled: check cluster.kubernetes.image (name, tag) and image_pull_secrets",
    "InvalidImageName": "cluster.kubernetes.image is not a valid image reference",
    "ErrImageNeverPull": "image_pull_policy is Never and the image is not on the node: use IfNotPresent or pre-load it",
    "CreateContainerConfigError": "the container cannot be configured: create the Secrets named in "
    "cluster.kubernetes.secret_env (with those keys) in the namespace",
    "CreateContainerError": "the container cannot be created: check the image's entrypoint and the pod's settings",
}


@dataclass(frozen=True)
class PodVerdict:
    """One pod of a launch as the job sees it."""

    name: str
    index: int | None  # the node (Job completion index)
    state: str  # "pending" | "running" | "succeeded" | "failed"
    cause: str | None = None  # for "failed": oom / node_lost / worker_failure / kube_config
    exit_code: int | None = None  # for "failed": the container's, or LOST_EXIT / CONFIG_EXIT
    message: str = ""  # what happened, and for kube_config what to fix
    host: str | None = None  # the Kubernetes node the pod was scheduled to (spec.nodeName)

    @property
    def fatal(self) -> bool:
        """A configuration error: the whole job fails now and is not relaunched."""
        return self.cause == "kube_config"


def _time(stamp: str | None) -> float | None:
    if not stamp:
        return None
    return datetime.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp()


def _condition(status: dict, type_: str) -> dict | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), None)


Failure = tuple[str, int | None, str]  # a "failed" verdict's cause, exit code and message


def pod_verdict(pod: dict, now: float, unschedulable_after_s: float, deleted: bool = False) -> PodVerdict:
    """The verdict on ``pod`` at time ``now`` (epoch seconds). ``deleted``: the pod is gone from
    the API (a DELETED watch event) — if it had not ended, its node is lost."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    name = meta.get("name", "?")
    raw_index = (meta.get("annotations") or {}).get(INDEX) or (meta.get("labels") or {}).get(INDEX)
    index = int(raw_index) if raw_index is not None and str(raw_index).isdigit() else None
    host = (pod.get("spec") or {}).get("nodeName") or None
    states = [s.get("state") or {} for s in status.get("containerStatuses") or []]
    terminated = next((s["terminated"] for s in states if s.get("terminated")), None)
    waiting = next((s["waiting"] for s in states if s.get("waiting")), None)
    code = terminated.get("exitCode") if terminated else None

    if status.get("phase") == "Succeeded" or code == 0:
        return PodVerdict(name, index, "succeeded", host=host)
    failure = (
        _node_lost(name, status, code)
        or _ended(name, meta, status, terminated, code, deleted)
        or _cannot_run(name, status, waiting, now, unschedulable_after_s)
    )
    if failure:
        return PodVerdict(name, index, "failed", *failure, host)
    return PodVerdict(name, index, "running" if status.get("phase") == "Running" else "pending", host=host)


def _node_lost(name: str, status: dict, code: int | None) -> Failure | None:
    """The pod's node went away under it: a disruption (preemption, eviction, a node not ready)
    or what the kubelet says of the pod (evicted, its node lost or shut down)."""
    lost_code = code if code is not None else LOST_EXIT
    disruption = _condition(status, "DisruptionTarget")
    if disruption and disruption.get("status") == "True":
        reason = disruption.get("reason") or "DisruptionTarget"
        what = (
            "preempted"
            if "Preemption" in reason
            else "node not ready or unreachable"
            if reason == "DeletionByTaintManager"
            else "evicted"
        )
        return "node_lost", lost_code, f"pod {name} {what} ({reason}: {disruption.get('message', '')})"
    if status.get("reason") in ("Evicted", "NodeLost", "Terminated", "Shutdown", "NodeShutdown"):
        return "node_lost", lost_code, f"pod {name}: {status['reason']}: {status.get('message', '')}"
    return None


def _ended(
    name: str, meta: dict, status: dict, terminated: dict | None, code: int | None, deleted: bool
) -> Failure | None:
    """The pod's container ended, or the pod was deleted: OOM-killed, deleted before it ended,
    the node agent refusing its arguments, or another non-zero exit."""
    if terminated and terminated.get("reason") == "OOMKilled":
        return (
            "oom",
            code,
            f"pod {name} was OOM-killed: its memory limit "
            "(cluster.kubernetes.memory_per_node, /dev/shm included) is too small for the model",
        )
    if meta.get("deletionTimestamp") or (deleted and status.get("phase") not in ("Succeeded", "Failed")):
        return "node_lost", code if code is not None else LOST_EXIT, f"pod {name} was deleted"
    if code in CONFIG_EXIT_CODES:
        return (
            "kube_config",
            code,
            f"pod {name}: the node agent exited with {code} (its command or "
            "image is wrong: the image must contain this project's trainer package and `python`)",
        )
    if code is not None:
        return "worker_failure", code, f"pod {name} exited with code {code}"
    if deleted:
        return "node_lost", LOST_EXIT, f"pod {name} was deleted"
    return None


def _cannot_run(
    name: str, status: dict, waiting: dict | None, now: float, unschedulable_after_s: float
) -> Failure | None:
    """The pod waits for what never comes by itself: an image it cannot pull, a Secret that is
    missing, a node that fits it (unschedulable for ``unschedulable_after_s``)."""
    if waiting and waiting.get("reason") in CONFIG_WAITING:
        reason = waiting["reason"]
        return (
            "kube_config",
            CONFIG_EXIT,
            f"pod {name}: {reason}: {waiting.get('message', '')} — {CONFIG_WAITING[reason]}",
        )
    scheduled = _condition(status, "PodScheduled")
    if scheduled and scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        since = _time(scheduled.get("lastTransitionTime"))
        if since is not None and now - since >= unschedulable_after_s:
            return (
                "kube_config",
                CONFIG_EXIT,
                f"pod {name} unschedulable for {now - since:.0f}s: {scheduled.get('message', '')} — no node "
                "fits it: lower cluster.kubernetes cpu/memory/gpus_per_node or fix node_selector/tolerations",
            )
    return None


def probe_stopped(v: PodVerdict, pod: dict, last_sign_of_life: float | None, silent_limit_s: float) -> float | None:
    """How long node ``v``'s agent had been silent when its container was SIGKILLed (exit 137,
    no other reason known: a ``worker_failure`` verdict), if that is at least ``silent_limit_s``
    (the liveness probe's limit, ``kubernetes.node_silent_s``): the probe stopped a frozen node
    (its agent's liveness file, last refreshed at ``last_sign_of_life``, had aged past the limit).
    None for anything else — a file never written, or a kill while the agent still gave signs of
    life (finishedAt has 1 s resolution)."""
    if not silent_limit_s or last_sign_of_life is None or v.cause != "worker_failure" or v.exit_code != LOST_EXIT:
        return None
    states = [s.get("state") or {} for s in (pod.get("status") or {}).get("containerStatuses") or []]
    finished = next((_time(s["terminated"].get("finishedAt")) for s in states if s.get("terminated")), None)
    if finished is None or finished + 1 - last_sign_of_life < silent_limit_s:
        return None
    return round(max(0.0, finished - last_sign_of_life), 1)


def frozen(v: PodVerdict, silent_s: float) -> PodVerdict:
    """``v`` as the lost node it was: its liveness probe stopped it after ``silent_s`` of silence."""
    return replace(
        v,
        cause="node_lost",
        message=f"pod {v.name} was stopped by its liveness probe: its agent gave no "
        f"sign of life for {silent_s:.0f}s (frozen: a hung process or machine)",
    )
