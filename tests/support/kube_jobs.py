"""The Job controller of the Kubernetes API test double.

Like kube-controller-manager's for what a training backend uses: an Indexed Job gets one pod
per index (``<job>-<index>-<suffix>``, ``hostname`` ``<job>-<index>``, the template's
``subdomain``, env ``JOB_COMPLETION_INDEX`` from the index annotation); a failed index is
replaced until ``backoffLimit``/``backoffLimitPerIndex``; ``podFailurePolicy`` rules
(FailJob/FailIndex/Ignore/Count on exit codes and pod conditions) decide what a failure means;
the Job's status (active/ready/succeeded/failed, completedIndexes, conditions Complete/Failed)
follows its pods. A pod deleted before it finished counts as failed, as with the real
controller's pod-tracking finalizers, unless the controller deleted it itself (``parallelism``
patched down: the highest indexes go; ``suspend``; the Job finished). A finished Job with
``ttlSecondsAfterFinished`` is deleted (background propagation) when it has passed.
"""

from __future__ import annotations

import copy
import threading
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from support.kube_objects import KubeError
from support.kube_store import Event, Store, now, owner_uids

INDEX = "batch.kubernetes.io/job-completion-index"
TERMINAL = ("Succeeded", "Failed")
TTL_TICK_S = 0.2  # how often finished Jobs with a TTL are looked at


def job_owner(pod: dict) -> str | None:
    for ref in pod["metadata"].get("ownerReferences") or []:
        if ref.get("kind") == "Job" and ref.get("controller"):
            return ref.get("uid")
    return None


def pod_index(pod: dict) -> int | None:
    value = (pod["metadata"].get("annotations") or {}).get(INDEX)
    return int(value) if value is not None else None


def exit_codes(pod: dict) -> dict[str, int]:
    return {
        s["name"]: s["state"]["terminated"]["exitCode"]
        for s in (pod.get("status") or {}).get("containerStatuses") or []
        if (s.get("state") or {}).get("terminated")
    }


def policy_action(rules: list[dict], pod: dict) -> tuple[str, int | None]:
    """The action of the first podFailurePolicy rule matching a failed pod (``Count`` if none)."""
    codes = exit_codes(pod)
    conditions = {(c["type"], c["status"]) for c in (pod.get("status") or {}).get("conditions") or []}
    for i, rule in enumerate(rules):
        on_codes = rule.get("onExitCodes")
        if on_codes:
            wanted = set(on_codes.get("values") or [])
            for container, code in codes.items():
                if on_codes.get("containerName") not in (None, container) or code == 0:
                    continue
                if (code in wanted) == (on_codes.get("operator", "In") == "In"):
                    return rule["action"], i
        for cond in rule.get("onPodConditions") or []:
            if (cond["type"], cond.get("status", "True")) in conditions:
                return rule["action"], i
    return "Count", None


def ranges(indexes: set[int]) -> str:
    """``{0, 1, 2, 5}`` → ``"0-2,5"`` (the format of completedIndexes/failedIndexes)."""
    out, run = [], []
    for i in sorted(indexes):
        if run and i != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(i)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


@dataclass
class _Tally:
    """A Job's ended pods, counted (``verdict``: why the Job failed, if it did)."""

    succeeded: set[int | None] = field(default_factory=set)  # the indexes (None: not an Indexed Job)
    done_pods: int = 0
    failed: int = 0
    failed_indexes: set[int | None] = field(default_factory=set)
    verdict: tuple[str, str] | None = None
    complete: bool = False


class JobController:
    """Reconciles every Job whenever a Job or Pod changes, in its own thread."""

    def __init__(self, store: Store):
        self.store = store
        self.outcomes: dict[str, dict[str, dict]] = {}  # job uid -> pod uid -> the pod as it ended
        self.discarded: set[str] = set()  # pods this controller deleted (scale-down, job ended): no failure
        self._wake = threading.Event()
        self._closed = False
        self._ttl_pending = False  # a finished Job waits for its ttlSecondsAfterFinished: poll
        store.listeners.append(self._on_event)
        self._thread = threading.Thread(target=self._loop, name="kube-job-controller", daemon=True)
        self._thread.start()

    def _on_event(self, e: Event) -> None:
        if e.plural == "pods" and (job := job_owner(e.obj)):
            ended = self.outcomes.setdefault(job, {})
            uid = e.obj["metadata"]["uid"]
            phase = (e.obj.get("status") or {}).get("phase")
            if uid not in ended and uid not in self.discarded and (phase in TERMINAL or e.type == "DELETED"):
                pod = copy.deepcopy(e.obj)
                if phase not in TERMINAL:  # deleted before it finished: a failure
                    pod.setdefault("status", {})["phase"] = "Failed"
                ended[uid] = pod
        if e.plural == "jobs" and e.type == "DELETED":
            self.outcomes.pop(e.obj["metadata"]["uid"], None)
        if e.plural in ("pods", "jobs"):
            self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait(TTL_TICK_S if self._ttl_pending else None)
            self._wake.clear()
            if self._closed:
                return
            with self.store.cond:
                self._ttl_pending = False
                for job in list(self.store.find("jobs", None)):
                    try:
                        self._reconcile(copy.deepcopy(job))
                    except KubeError:  # a pod or the job went meanwhile: the next pass sees it
                        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(10)

    def _reconcile(self, job: dict) -> None:
        meta, spec = job["metadata"], job["spec"]
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        if meta.get("deletionTimestamp"):
            return
        status = job.get("status") or {}
        conditions = list(status.get("conditions") or [])
        finished = any(c["type"] in ("Complete", "Failed") and c["status"] == "True" for c in conditions)
        if finished and self._expired(spec.get("ttlSecondsAfterFinished"), conditions):
            self.store.delete("jobs", ns, name, "Background")  # the TTL-after-finished controller
            return
        pods = [p for p in self.store.find("pods", ns) if uid in owner_uids(p)]
        live = [
            p for p in pods if p["status"].get("phase") not in TERMINAL and not p["metadata"].get("deletionTimestamp")
        ]
        rules = (spec.get("podFailurePolicy") or {}).get("rules") or []
        tally = self._tally(job, rules)
        # with a podFailurePolicy the only replacement policy is Failed: a terminating pod is replaced
        # only once it has failed (and then counts against the backoff limits)
        terminating = [
            p
            for p in pods
            if p["metadata"].get("deletionTimestamp")
            and p["status"].get("phase") not in TERMINAL
            and (rules or spec.get("podReplacementPolicy") == "Failed")
        ]
        ended = finished or tally.verdict or tally.complete or spec.get("suspend")
        if not ended:
            live += self._replace(job, tally, live, terminating)
        by_index = sorted(live, key=lambda p: pod_index(p) or 0)
        stop = live if ended else by_index[spec.get("parallelism", 1) :]  # scaled down: the highest indexes go
        for pod in stop:
            self.discarded.add(pod["metadata"]["uid"])
            self.store.delete("pods", ns, pod["metadata"]["name"], "Background")
        live = [p for p in live if p not in stop]
        self._set_status(job, tally, live, conditions, finished)

    def _tally(self, job: dict, rules: list[dict]) -> _Tally:
        """What the Job's ended pods add up to, and whether that ends the Job."""
        spec, ns = job["spec"], job["metadata"]["namespace"]
        tally = _Tally()
        per_index = Counter()
        for pod in self.outcomes.get(job["metadata"]["uid"], {}).values():
            index = pod_index(pod)
            if pod["status"]["phase"] == "Succeeded":
                tally.done_pods += 1
                tally.succeeded.add(index)
                continue
            action, rule = policy_action(rules, pod)
            if action == "Ignore":
                continue
            tally.failed += 1
            if action == "FailJob" and tally.verdict is None:
                tally.verdict = (
                    "PodFailurePolicy",
                    f"Pod {ns}/{pod['metadata']['name']} failed with exit codes "
                    f"{exit_codes(pod)} or conditions matching FailJob rule at index {rule}",
                )
            elif action == "FailIndex":
                tally.failed_indexes.add(index)
            else:
                per_index[index] += 1
        per_limit = spec.get("backoffLimitPerIndex")
        if per_limit is not None:
            tally.failed_indexes |= {i for i, n in per_index.items() if n > per_limit}
        if tally.verdict is None and tally.failed > spec.get("backoffLimit", 6):
            tally.verdict = ("BackoffLimitExceeded", "Job has reached the specified backoff limit")
        indexed, completions = spec.get("completionMode") == "Indexed", spec.get("completions")
        tally.complete = (
            (len(tally.succeeded - {None}) >= completions)
            if indexed
            else (completions is not None and tally.done_pods >= completions)
        )
        failed_indexes = tally.failed_indexes
        if (
            tally.verdict is None
            and indexed
            and failed_indexes
            and len(tally.succeeded | failed_indexes) >= completions
        ):
            tally.verdict = ("FailedIndexes", f"Job has failed indexes {ranges(failed_indexes)}")
        return tally

    def _replace(self, job: dict, tally: _Tally, live: list[dict], terminating: list[dict]) -> list[dict]:
        """The pods created for the indexes (or completions) that have none running."""
        spec, ns = job["spec"], job["metadata"]["namespace"]
        completions, parallelism = spec.get("completions"), spec.get("parallelism", 1)
        busy = {pod_index(p) for p in live + terminating}
        if spec.get("completionMode") == "Indexed":
            todo = [i for i in range(completions) if i not in tally.succeeded | tally.failed_indexes | busy]
        else:
            running = len(live) + len(terminating)
            left = (completions - tally.done_pods - running) if completions is not None else parallelism - running
            todo = [None] * max(0, left)
        room = max(0, parallelism - len(live) - len(terminating))
        return [self.store.create("pods", ns, self._pod(job, index)) for index in todo[:room]]

    def _set_status(self, job: dict, tally: _Tally, live: list[dict], conditions: list[dict], finished: bool) -> None:
        meta, spec = job["metadata"], job["spec"]
        status = job.get("status") or {}
        stamp = now()
        if not finished and tally.verdict:
            conditions += [
                self._condition("FailureTarget", *tally.verdict, stamp),
                self._condition("Failed", *tally.verdict, stamp),
            ]
        elif not finished and tally.complete:
            conditions.append(self._condition("Complete", "", "", stamp))
        new = {
            "active": len(live),
            "ready": sum(1 for p in live if _ready(p)),
            "succeeded": tally.done_pods,
            "failed": tally.failed,
            "startTime": status.get("startTime") or stamp,
            "conditions": conditions,
            "uncountedTerminatedPods": {},
        }
        if spec.get("completionMode") == "Indexed":
            new["completedIndexes"] = ranges(tally.succeeded - {None})
            if spec.get("backoffLimitPerIndex") is not None:
                new["failedIndexes"] = ranges(tally.failed_indexes)
        if any(c["type"] == "Complete" for c in conditions):
            new["completionTime"] = status.get("completionTime") or stamp
        if status != new:
            self.store.update("jobs", meta["namespace"], meta["name"], lambda j: j.__setitem__("status", new))

    def _expired(self, ttl: int | None, conditions: list[dict]) -> bool:
        if ttl is None:
            return False
        ended = max(
            datetime.strptime(c["lastTransitionTime"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
            for c in conditions
            if c["type"] in ("Complete", "Failed")
        )
        if datetime.now(timezone.utc) >= ended + timedelta(seconds=ttl):
            return True
        self._ttl_pending = True
        return False

    @staticmethod
    def _condition(type_: str, reason: str, message: str, stamp: str) -> dict:
        cond = {"type": type_, "status": "True", "lastProbeTime": stamp, "lastTransitionTime": stamp}
        return {**cond, "reason": reason, "message": message} if reason else cond

    @staticmethod
    def _pod(job: dict, index: int | None) -> dict:
        name, template = job["metadata"]["name"], copy.deepcopy(job["spec"]["template"])
        meta = template.get("metadata") or {}
        labels, annotations = dict(meta.get("labels") or {}), dict(meta.get("annotations") or {})
        spec = template["spec"]
        prefix = f"{name}-"
        if index is not None:
            labels[INDEX] = annotations[INDEX] = str(index)
            spec["hostname"] = f"{name}-{index}"
            prefix = f"{name}-{index}-"
            for container in spec["containers"] + (spec.get("initContainers") or []):
                env = container.setdefault("env", [])
                if not any(e["name"] == "JOB_COMPLETION_INDEX" for e in env):
                    env.append(
                        {
                            "name": "JOB_COMPLETION_INDEX",
                            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX}']"}},
                        }
                    )
        owner = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": name,
            "uid": job["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
        return {
            "metadata": {
                "generateName": prefix[:58],
                "labels": labels,
                "annotations": annotations,
                "ownerReferences": [owner],
            },
            "spec": spec,
        }


def _ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])
