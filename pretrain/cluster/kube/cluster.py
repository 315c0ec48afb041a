"""Training jobs as Kubernetes workloads: ``KubeCluster`` implements the ``Cluster``/``JobHandle``
interface of ``pretrain.cluster.local`` with the Service + Indexed Job of ``pretrain.cluster.kube.manifests``.

Where the pods find their job: the campaign workdir is shared (``cluster.kubernetes.workdir_claim``,
a ReadWriteMany volume mounted at the workdir's path in every pod), so ``job.json``, the job's
metrics and events and the checkpoints are where the local cluster puts them, and the flow reads
them the same way. Pod logs are copied into the job directory (``node<i>.log``) when a pod ends.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.cluster.kube.handle import KubeJobHandle
from pretrain.cluster.kube.manifests import LABEL, Launch, launch_labels
from pretrain.cluster.kube.nodecheck import HOSTS, HostMemory, check_launch, checks_dir, result_rows, wait_settled
from pretrain.cluster.local import Cluster, ClusterError, JobHandle
from pretrain.settings import PretrainSettings
from pretrain.spec.campaign import CampaignSpec
from pretrain.spec.layout import CampaignLayout
from trainer.job.config import JobConfig

ADOPT_WAIT_S = 60.0  # how long a Job left over from an earlier, stopped launch may take to go


def selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _already_exists(e) -> bool:
    return getattr(e, "status", None) == 409


@dataclass
class KubeCluster(Cluster):
    """The campaign's stages as Kubernetes Jobs (``api``: a ``kubernetes.client.ApiClient``)."""

    spec: CampaignSpec
    api: object = field(repr=False)
    settings: PretrainSettings = field(default_factory=PretrainSettings.from_env)
    unschedulable_after_s: float = 120.0  # a pod no node can take for this long: a configuration error
    adopts_live_jobs = True  # Jobs train on in the cluster when the flow process dies

    def live_job(self, stage: str, attempt: int) -> str | None:
        """The live Job of this launch (found by its labels: campaign, stage, attempt), if any."""
        from kubernetes import client

        ns = self.spec.cluster.kubernetes.namespace
        try:
            jobs = (
                client.BatchV1Api(self.api)
                .list_namespaced_job(ns, label_selector=selector(launch_labels(self.spec.name, stage, attempt)))
                .items
            )
        except client.ApiException as e:
            raise ClusterError(_api_error(e, f"list Jobs in {ns}")) from e
        return next(
            (
                f"{ns}/{j.metadata.name}"
                for j in jobs
                if j.metadata.deletion_timestamp is None
                and not any(
                    c.type in ("Complete", "Failed") and c.status == "True"
                    for c in (j.status and j.status.conditions) or ()
                )
            ),
            None,
        )

    def health_check(
        self, workdir: Path, delays: dict[int, float] | None = None, nodes: list[int] | None = None
    ) -> list[dict]:
        """The node check as an Indexed Job of pods shaped like training's (``pretrain.cluster.kube.nodecheck``):
        one row per worker slot, with ``host``, the Kubernetes node its pod ran on. ``workdir`` is the
        campaign's (the pods write their rows there). Torn down before it returns."""
        from kubernetes import client

        picked = list(range(self.spec.cluster.node_count)) if nodes is None else list(nodes)
        if not picked:
            return []
        launch = check_launch(self.spec, picked, delays)
        try:
            service, manifest = launch.manifests()
        except ValueError as e:
            raise ClusterError(str(e)) from e
        Path(launch.out_dir).mkdir(parents=True, exist_ok=True)  # on the shared workdir: the pods write here
        core, batch = client.CoreV1Api(self.api), client.BatchV1Api(self.api)
        ns, name = launch.kube.namespace, launch.name
        handle = KubeJobHandle(
            self.api,
            ns,
            name,
            selector(launch.selector()),
            len(picked),
            len(picked),
            Path(launch.out_dir),
            self.unschedulable_after_s,
        )
        try:
            core.create_namespaced_service(ns, service)
            self._own_service(core, ns, name, batch.create_namespaced_job(ns, manifest).metadata.uid)
        except client.ApiException as e:
            handle.stop(grace_s=0)  # whatever was created goes
            raise ClusterError(_api_error(e, f"create the node check {ns}/{name}")) from e
        handle.begin()
        try:
            verdicts, waited = wait_settled(
                handle, len(picked), self.settings.health_check_timeout_s + self.unschedulable_after_s
            )
            logs = {
                k: handle.read_log(v.name) or "" for k, v in verdicts.items() if v.state == "failed" and not v.fatal
            }
            rows = result_rows(launch, verdicts, logs, waited)
        finally:
            handle.stop(grace_s=self.settings.stop_grace_s)
        HostMemory(checks_dir(self.spec.workdir_path) / HOSTS).update({r["node"]: r["host"] for r in rows if r["host"]})
        return rows

    def start(
        self, job: JobConfig, job_path: Path, layout: CampaignLayout, exclude: set[int] = frozenset()
    ) -> JobHandle:
        """Create the launch's Service and Indexed Job — or adopt them if they exist (a re-run flow
        process finds the Job it started before) — and return a handle that watches its pods."""
        from kubernetes import client

        c = self.spec.cluster
        healthy = c.node_count - len(set(exclude) & set(range(c.node_count)))
        if healthy < c.nodes_min:
            raise ClusterError(
                f"only {healthy} healthy node(s) (excluded: {sorted(exclude)}), cluster.nodes_min is "
                f"{c.nodes_min}: repair or replace the nodes, or lower nodes_min"
            )
        nodes = min(c.nodes_max, healthy)  # the rest stand by: one takes a lost pod's place
        hosts, avoid_notices = HostMemory(checks_dir(layout.root) / HOSTS).avoid(set(exclude)) if exclude else ((), [])
        launch = Launch(self.spec, job, str(job_path), nodes, avoid_hosts=hosts, spare_nodes=healthy - nodes)
        try:
            service, manifest = launch.manifests()
        except ValueError as e:
            raise ClusterError(str(e)) from e
        core, batch = client.CoreV1Api(self.api), client.BatchV1Api(self.api)
        ns, name = launch.kube.namespace, launch.name
        labels = launch_labels(self.spec.name, job.stage.name, job.attempt)
        retired = self._retire_stale(batch, ns, labels, job.attempt)
        try:
            core.create_namespaced_service(ns, service)
        except client.ApiException as e:
            if not _already_exists(e):
                raise ClusterError(_api_error(e, f"create Service {ns}/{name}")) from e
            self._check_ours(core.read_namespaced_service(name, ns), labels, "Service")
        live = self._create_job(batch, ns, name, manifest, labels)
        adopted = live is not None
        if live is None:
            live = batch.read_namespaced_job(name, ns)
        self._own_service(core, ns, name, live.metadata.uid)
        handle = KubeJobHandle(
            self.api,
            ns,
            name,
            selector(labels),
            healthy,
            c.nodes_min,
            Path(job.job_dir),
            self.unschedulable_after_s,
            adopted=adopted,
            spare_nodes=healthy - nodes,
            silent_after_s=launch.kube.node_silent_s,
        )
        handle.notices = tuple(
            [f"adopted the live Job {ns}/{name} of this launch"] * adopted
            + [
                f"deleted Job {ns}/{r} of an earlier launch of this stage (its orchestrator is gone; this launch "
                "resumes from the newest good checkpoint)"
                for r in retired
            ]
            + avoid_notices
        )
        handle.begin()
        return handle

    @staticmethod
    def _own_service(core, ns: str, name: str, job_uid: str) -> None:
        """The Service goes with the Job of its name (its own TTL is the Job's)."""
        from kubernetes import client

        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": job_uid, "blockOwnerDeletion": True}
        try:
            core.patch_namespaced_service(name, ns, {"metadata": {"ownerReferences": [owner]}})
        except client.ApiException as e:
            raise ClusterError(_api_error(e, f"patch Service {ns}/{name}")) from e

    def _retire_stale(self, batch, ns: str, labels: dict[str, str], attempt: int) -> list[str]:
        """Delete live Jobs of this campaign's stage from other launches: the campaign's single-run
        lock means their orchestrator died, and two launches of one stage must never train at once."""
        from kubernetes import client

        stage = {k: v for k, v in labels.items() if k != f"{LABEL}/attempt"}
        try:
            jobs = batch.list_namespaced_job(ns, label_selector=selector(stage)).items
        except client.ApiException as e:
            raise ClusterError(_api_error(e, f"list Jobs in {ns}")) from e
        stale = [j for j in jobs if (j.metadata.labels or {}).get(f"{LABEL}/attempt") != str(attempt)]
        for j in stale:
            old = {**stage, f"{LABEL}/attempt": (j.metadata.labels or {}).get(f"{LABEL}/attempt", "")}
            KubeJobHandle(
                self.api,
                ns,
                j.metadata.name,
                selector(old),
                0,
                1,
                Path(self.spec.workdir_path),
                self.unschedulable_after_s,
            ).stop(grace_s=self.settings.stop_grace_s)
        return [j.metadata.name for j in stale]

    def _create_job(self, batch, ns: str, name: str, manifest: dict, labels: dict[str, str]):
        """None when created; the live Job when one of this launch exists (adopted). A Job of this
        launch still being deleted (an earlier stop) is waited for, then created anew."""
        from kubernetes import client

        deadline = time.monotonic() + ADOPT_WAIT_S
        while True:
            try:
                batch.create_namespaced_job(ns, manifest)
                return None
            except client.ApiException as e:
                if not _already_exists(e):
                    raise ClusterError(_api_error(e, f"create Job {ns}/{name}")) from e
            try:
                live = batch.read_namespaced_job(name, ns)
            except client.ApiException as e:
                if e.status == 404:
                    continue  # it went meanwhile: create it
                raise ClusterError(_api_error(e, f"read Job {ns}/{name}")) from e
            self._check_ours(live, labels, "Job")
            if live.metadata.deletion_timestamp is None:
                return live
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"Job {ns}/{name} of an earlier launch is still being deleted after "
                    f"{ADOPT_WAIT_S:.0f}s: check its pods (kubectl -n {ns} get pods -l "
                    f"{selector(labels)}) and delete them"
                )
            threading.Event().wait(0.2)  # the API's garbage collector removes it: poll with a deadline

    @staticmethod
    def _check_ours(obj, labels: dict[str, str], kind: str) -> None:
        found = obj.metadata.labels or {}
        if any(found.get(k) != v for k, v in labels.items()):
            raise ClusterError(
                f"{kind} {obj.metadata.namespace}/{obj.metadata.name} exists but is not this launch's "
                f"(labels {found}): delete it, or rename the campaign"
            )


def _api_error(e, what: str) -> str:
    """An ApiException as one line saying what failed and what to do."""
    import json

    try:
        message = json.loads(e.body).get("message") or e.reason
    except (TypeError, ValueError, AttributeError):
        message = e.reason
    hint = {
        401: "the credentials in your kubeconfig are not accepted",
        403: "the service account lacks this permission: apply deploy/kubernetes (RBAC)",
        404: "check cluster.kubernetes.namespace exists",
    }.get(e.status, "")
    return f"Kubernetes API: cannot {what}: {e.status} {message}" + (f" ({hint})" if hint else "")
