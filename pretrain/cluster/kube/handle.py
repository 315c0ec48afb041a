"""``KubeJobHandle``: one launch's Indexed Job seen from the flow, with the elastic semantics of
the local cluster's handle (the job runs while at least ``nodes_min`` nodes do; a node that
dropped out meanwhile is *lost*; the job succeeds when a node finishes cleanly).

Standby pods (``cluster.spare_nodes``: the highest indices) are optional: one that cannot run
(no node fits it, its pod never made) is left out with a notice, and the job goes on without it.

A background thread keeps the launch's pods current (``pretrain.cluster.kube.watch``); ``poll()``
judges them (``pretrain.cluster.kube.pods``). The failure that ends a job is written to its events
(``error_type`` KubeConfigError / PodLost / PodOOMKilled, so ``pretrain.run.incidents`` names its
cause) and failed pods' log tails are kept (``pretrain.cluster.kube.pod_logs``).
"""

from __future__ import annotations

import time
from pathlib import Path

from pretrain.cluster.kube.pod_logs import PodLogs
from pretrain.cluster.kube.pods import CONFIG_EXIT, PodVerdict, frozen, pod_verdict, probe_stopped
from pretrain.cluster.kube.watch import PodWatch
from pretrain.cluster.local import DONE_SILENT_S, ClusterError, JobHandle
from trainer.job.events import EventKind
from trainer.job.layout import JobLayout
from trainer.job.reporting import JsonLines
from trainer.liveness import silent_for

STOPPED_EXIT = 143  # what poll() says after stop() when no pod ended on its own (SIGTERM)
ERROR_TYPES = {
    "kube_config": ("KubeConfigError", []),
    "node_lost": ("PodLost", []),
    "oom": ("PodOOMKilled", ["OutOfMemoryError"]),
}


class KubeJobHandle(JobHandle):
    def __init__(
        self,
        api,
        namespace: str,
        name: str,
        selector: str,
        nodes: int,
        nodes_min: int,
        job_dir: Path,
        unschedulable_after_s: float,
        adopted: bool = False,
        spare_nodes: int = 0,
        silent_after_s: float = 0.0,
    ):
        """``silent_after_s``: the pods' liveness probe limit (``kubernetes.node_silent_s``; 0: none)."""
        self.api, self.namespace, self.name, self.selector = api, namespace, name, selector
        self.nodes, self.nodes_min, self.job_dir = nodes, nodes_min, Path(job_dir)  # nodes: the standby pods' included
        self._spares = spare_nodes  # the standby pods: the highest indices
        self._unplaced: dict[int, str] = {}  # standby indices whose pod cannot run → why (the job goes on without them)
        self._told = 0  # unplaced standby pods already named by new_notices()
        self.unschedulable_after_s = unschedulable_after_s
        self.silent_after_s = silent_after_s
        self.silent: dict[int, float] = {}  # nodes stopped because they went silent (frozen) → seconds silent
        self._silent_notices: list[str] = []
        self.adopted = adopted  # the Job existed (an earlier flow process started it)
        self._watch = PodWatch(api, namespace, selector, name)
        self._pod_logs = PodLogs(api, namespace, self.job_dir, nodes)
        self.logs = self._pod_logs.paths
        self._stopped = False
        self._began = time.monotonic()
        self._reported = False

    def begin(self) -> None:
        self._began = time.monotonic()
        self._watch.begin()

    # -- the job's state
    def _judged(self) -> list[PodVerdict]:
        """Every pod of the launch seen so far, oldest first, judged now."""
        now = time.time()
        return [
            self._probed(v, pod)
            for pod, deleted in self._watch.pods()
            if (v := pod_verdict(pod, now, self.unschedulable_after_s, deleted)).index is not None
        ]

    def _probed(self, v: PodVerdict, pod: dict) -> PodVerdict:
        """A pod its liveness probe stopped (its agent's liveness file in the job directory had
        aged past the limit when it was SIGKILLed) is a frozen node: lost, not a worker failure."""
        if v.state != "failed" or not self.silent_after_s:
            return v
        now = time.time()
        # no file (not written, the job directory not shared) or a damaged one: judged by its exit code alone
        silent_now = silent_for(self.job_dir, v.index, None, now=now)
        silent = None if silent_now is None else probe_stopped(v, pod, now - silent_now, self.silent_after_s)
        if silent is None:
            return v
        self._stopped_silent(v.index, silent, "its liveness probe stopped its pod")
        return frozen(v, silent)

    def _stopped_silent(self, node: int, silent: float, how: str) -> None:
        if node not in self.silent:
            self.silent[node] = silent
            self._silent_notices.append(
                f"node {node} gave no sign of life for {silent:.0f}s (frozen, or cut off): {how}"
            )

    def _delete_silent_after_done(self, verdicts: dict[int, PodVerdict]) -> None:
        """Once a node finished the job the others are only leaving: a running pod whose agent
        missed a few beats (``DONE_SILENT_S``) is frozen, and is deleted at once rather than left
        to its liveness probe and the kubelet's grace period (a minute with the defaults)."""
        from kubernetes import client
        from urllib3.exceptions import HTTPError

        if self._stopped or not any(v.state == "succeeded" for v in verdicts.values()):
            return
        for v in verdicts.values():
            silent = (
                silent_for(self.job_dir, v.index, None) if v.state == "running" and v.index not in self.silent else None
            )
            if silent is None or silent < DONE_SILENT_S:
                continue
            try:
                client.CoreV1Api(self.api).delete_namespaced_pod(v.name, self.namespace, grace_period_seconds=0)
            except (client.ApiException, HTTPError, OSError):
                continue  # the next poll tries again
            self._stopped_silent(
                v.index, round(silent, 1), f"deleted its pod {v.name} (the job finished on another node)"
            )

    @property
    def spare_nodes(self) -> int:
        """Standby pods that can take a lost node's place (those that cannot run do not count)."""
        return self._spares - len(self._unplaced)

    def _standby(self, index: int) -> bool:
        return index >= self.nodes - self._spares

    def _placed(self, judged: list[PodVerdict]) -> dict[int, PodVerdict]:
        """The newest of ``judged`` per node index, standby pods that cannot run left out (and noted)."""
        newest = {v.index: v for v in judged}
        for index, v in newest.items():
            if self._standby(index) and v.fatal and v.exit_code == CONFIG_EXIT:
                self._unplaced.setdefault(
                    index, v.message
                )  # never ran (unschedulable, image): only a standby is missing
        return {index: v for index, v in newest.items() if index not in self._unplaced}

    def verdicts(self) -> dict[int, PodVerdict]:
        """The newest pod of each node index, judged now; standby pods that cannot run left out."""
        return self._placed(self._judged())

    def new_notices(self) -> list[str]:
        fresh = list(self._unplaced.items())[self._told :]
        self._told += len(fresh)
        told, self._silent_notices = self._silent_notices, []
        return [
            f"standby node {index} cannot run ({why.split(' — ')[0]}): the job goes on without it; free room on the "
            "cluster for it or lower cluster.spare_nodes"
            for index, why in fresh
        ] + told

    def lost_nodes(self) -> dict[int, int]:
        """Nodes with a pod that failed (index → its exit code), even if the Job replaced the pod
        since (a disruption is not counted against the Job: its pod is replaced and rejoins)."""
        lost: dict[int, int] = {}
        judged = self._judged()
        self._placed(judged)  # notes standby pods that cannot run: they are not lost nodes
        for v in judged:
            if v.state == "failed" and v.index not in self._unplaced:
                lost.setdefault(v.index, v.exit_code)
        return lost

    def poll(self) -> int | None:
        verdicts = self.verdicts()
        self._delete_silent_after_done(verdicts)
        failed = [v for v in verdicts.values() if v.state == "failed"]
        for v in verdicts.values():
            if v.state in ("failed", "succeeded"):
                self._pod_logs.keep(v, failed=v.state == "failed")
        if self._stopped:
            return (
                0
                if any(v.state == "succeeded" for v in verdicts.values())
                else (failed[0].exit_code if failed else STOPPED_EXIT)
            )
        fatal = next((v for v in failed if v.fatal), None) or self._missing(verdicts)
        if fatal is not None:
            return self._failed(fatal)
        nodes = self.nodes - len(self._unplaced)
        if any(v.state in ("pending", "running") for v in verdicts.values()) or len(verdicts) < nodes:
            alive = nodes - len(failed)
            return None if alive >= self.nodes_min else self._failed(failed[0])
        return 0 if any(v.state == "succeeded" for v in verdicts.values()) else self._failed(failed[0])

    def _missing(self, verdicts: dict[int, PodVerdict]) -> PodVerdict | None:
        """A configuration error when the Job has not made a pod for every node in time (a
        ResourceQuota, LimitRange or admission webhook refusing them)."""
        missing = sorted(set(range(self.nodes)) - set(verdicts) - set(self._unplaced))
        waited = time.monotonic() - self._began
        if not missing or waited < self.unschedulable_after_s:
            return None
        for index in filter(self._standby, missing):
            self._unplaced[index] = f"the Job made no pod for it in {waited:.0f}s"
        missing = [i for i in missing if i not in self._unplaced]
        if not missing:
            return None
        return PodVerdict(
            self.name,
            missing[0],
            "failed",
            "kube_config",
            CONFIG_EXIT,
            f"Job {self.namespace}/{self.name} made no pod for node(s) {missing} in {waited:.0f}s: a "
            "ResourceQuota, LimitRange or admission policy refuses them — see `kubectl -n "
            f"{self.namespace} describe job {self.name}` and fix the quota or cluster.kubernetes resources",
        )

    def _failed(self, v: PodVerdict) -> int:
        """Record (once) why the job failed: an error event the incident classification reads."""
        if not self._reported and v.cause in ERROR_TYPES:
            self._reported = True
            error_type, causes = ERROR_TYPES[v.cause]
            events = JsonLines(JobLayout(self.job_dir).events)
            try:
                events.write(
                    {
                        "event": EventKind.ERROR,
                        "error": f"{error_type}: {v.message}",
                        "error_type": error_type,
                        "cause_types": causes,
                        "node": v.index,
                        "exit_code": v.exit_code,
                        "source": "kubernetes",
                    }
                )
            finally:
                events.close()
        return v.exit_code if v.exit_code else 1

    def failure_logs(self) -> dict[int, str]:
        """Log tails of the pods that failed (node index → text), for the flow run's logs."""
        return dict(self._pod_logs.tails)

    def read_log(self, pod: str) -> str | None:
        """The end of ``pod``'s log; None when it has none (never started, or gone)."""
        return self._pod_logs.read(pod)

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None and (deadline is None or time.monotonic() < deadline):
            self._watch.closed.wait(0.2)  # the watcher updates the pods meanwhile
        return code

    def stop(self, grace_s: float = 10.0) -> None:
        """Foreground-delete the Job (its pods go with it, each with ``grace_s`` to save) and the
        Service; returns when no pod of the launch is left (idempotent). ClusterError when the API
        cannot be reached or the pods do not go: it names the command that finishes the job."""
        from kubernetes import client
        from urllib3.exceptions import HTTPError

        cleanup = (
            f"kubectl -n {self.namespace} delete job {self.name} --cascade=foreground; "
            f"kubectl -n {self.namespace} delete pods,services -l {self.selector}"
        )
        try:
            self._teardown(max(0, int(grace_s)))
        except (client.ApiException, HTTPError, OSError) as e:
            raise ClusterError(
                f"could not tear down Job {self.namespace}/{self.name} ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200]}): its TTL removes it later, or run: {cleanup}"
            ) from e
        except TimeoutError as e:
            raise ClusterError(f"{e}: run {cleanup} --force") from e
        finally:
            self._watch.close()  # the watcher ends whatever happened

    def _teardown(self, grace: int) -> None:
        from kubernetes import client

        core, batch = client.CoreV1Api(self.api), client.BatchV1Api(self.api)
        for v in self.verdicts().values():  # the logs of pods still there, before they go
            if v.state in ("running", "succeeded"):
                self._pod_logs.keep(v, failed=False)
        self._stopped = True
        pods = [p.metadata.name for p in core.list_namespaced_pod(self.namespace, label_selector=self.selector).items]
        calls = [
            lambda: batch.delete_namespaced_job(
                self.name, self.namespace, propagation_policy="Foreground", grace_period_seconds=grace
            )
        ]
        calls += [
            lambda pod=pod: core.delete_namespaced_pod(pod, self.namespace, grace_period_seconds=grace) for pod in pods
        ]
        calls += [lambda: core.delete_namespaced_service(self.name, self.namespace)]
        for call in calls:
            try:
                call()
            except client.ApiException as e:
                if e.status != 404:
                    raise
        deadline = time.monotonic() + grace + 30
        while core.list_namespaced_pod(self.namespace, label_selector=self.selector).items or self._job_exists(batch):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"pods of Job {self.namespace}/{self.name} still exist {grace + 30}s after it was deleted"
                )
            self._watch.closed.wait(0.2)  # the kubelet ends the containers: poll with a deadline

    def _job_exists(self, batch) -> bool:
        from kubernetes import client

        try:
            batch.read_namespaced_job(self.name, self.namespace)
            return True
        except client.ApiException as e:
            if e.status == 404:
                return False
            raise
