"""The Kubernetes objects of one stage launch, as plain dicts (no API calls): a headless Service
whose DNS name makes pod 0 the c10d rendezvous endpoint, and an Indexed Job with one pod per node
running the same node agent as the local cluster (``python -m trainer.launch``).

Supported Kubernetes versions: 1.29 (the oldest: ``backoffLimitPerIndex`` and the ``FailIndex``
podFailurePolicy action are beta and on by default from 1.29) to 1.37.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from dataclasses import dataclass

from pretrain.spec.campaign import CampaignSpec
from pretrain.spec.kube import KubernetesSpec, quantity_bytes
from trainer.checkpoint.sizing import HEADER_BYTES, PAGE, snapshot_capacity
from trainer.job.config import STANDBY_NODE_ENV, JobConfig
from trainer.job.layout import JobLayout

OLDEST_K8S, NEWEST_K8S = "1.29.0", "1.37.0"
CONTAINER = "node"
NAME_MAX = 52  # pods are <job>-<index>-<5 chars>; hostnames <job>-<index> stay ≤ 63
SHM_BASE = 256 << 20  # room on /dev/shm for the collectives besides the snapshots
CONFIG_EXIT_CODES = [2, 78, 126, 127]  # usage error (argparse), EX_CONFIG, not executable, not found: never retried
LABEL = "pretrain.io"
UNREACHABLE_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")  # a node that stopped reporting


def _digest(*parts: str, n: int = 8) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:n]


def object_name(campaign: str, stage: str, attempt: int) -> str:
    """DNS-1035 name of the launch's Service and Job: readable prefix, hash of the exact identity
    (so two campaigns whose names differ only in case or punctuation never share objects)."""
    base = re.sub(r"[^a-z0-9]+", "-", f"pt-{campaign}-{stage}-a{attempt}".lower()).strip("-")
    suffix = _digest(campaign, stage, str(attempt))
    return f"{base[: NAME_MAX - len(suffix) - 1].rstrip('-')}-{suffix}"


def label_value(value: str) -> str:
    """``value`` if it is a valid label value, else a valid one with a hash of the original."""
    if re.fullmatch(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?", value):
        return value
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "-", value)[:54].strip("-_.")
    return f"{cleaned}-{_digest(value)}" if cleaned else _digest(value)


def launch_labels(campaign: str, stage: str, attempt: int) -> dict[str, str]:
    """Labels that select every object of one launch (the backend adopts live objects by them)."""
    return {
        "app.kubernetes.io/name": "pretrain",
        "app.kubernetes.io/managed-by": "prefect-pretrain",
        f"{LABEL}/campaign": label_value(campaign),
        f"{LABEL}/stage": label_value(stage),
        f"{LABEL}/attempt": str(attempt),
    }


def node_shm_bytes(job: JobConfig, workers_per_node: int, nodes: int) -> int:
    """Shared memory the fullest node needs: two page-aligned slots per worker (0 without flash snapshots)."""
    if not job.checkpoint.memory_interval:
        return 0
    world = workers_per_node * nodes

    def slot(rank: int) -> int:
        return -(-(HEADER_BYTES + snapshot_capacity(job, rank, world)) // PAGE) * PAGE

    return max(sum(2 * slot(n * workers_per_node + lr) for lr in range(workers_per_node)) for n in range(nodes))


def shm_limit(kube: KubernetesSpec, need: int, shm_fallback: bool) -> int:
    """Bytes of the /dev/shm emptyDir; ValueError naming both numbers when it does not fit the pod."""
    mib = 1 << 20
    if kube.shm_size == "auto":
        size = -(-(need + SHM_BASE) // mib) * mib
    else:
        size = quantity_bytes(kube.shm_size)
        if size < need and not shm_fallback:
            raise ValueError(
                f"cluster.kubernetes.shm_size {kube.shm_size} ({size // mib} MiB) is smaller than the "
                f"{-(-need // mib)} MiB the checkpoint snapshots of a node need: set shm_size: auto or "
                "larger, or checkpoint.shm_fallback: true"
            )
    memory = quantity_bytes(kube.memory_per_node)
    if size > memory:
        raise ValueError(
            f"/dev/shm needs {size // mib} MiB (flash checkpoint snapshots {-(-need // mib)} MiB) but the "
            f"pod's memory limit cluster.kubernetes.memory_per_node is {kube.memory_per_node} "
            f"({memory // mib} MiB), and memory-backed volumes count against it: raise memory_per_node, "
            "or set checkpoint.memory_interval: 0 to checkpoint without snapshots"
        )
    return size


@dataclass(frozen=True)
class Launch:
    """One launch of a stage: what the manifests are made from."""

    spec: CampaignSpec
    job: JobConfig
    job_location: str  # where the pods read the job's JobConfig JSON (a path on the workdir volume)
    nodes: int  # pods that train (≤ cluster.nodes_max): completion indices 0 … nodes - 1
    avoid_hosts: tuple[str, ...] = ()  # Kubernetes nodes that failed the node check: the pods must not run there
    spare_nodes: int = (
        0  # standby pods after them (indices nodes … nodes + spare_nodes - 1): one takes a lost pod's place
    )

    @property
    def kube(self) -> KubernetesSpec:
        return self.spec.cluster.kubernetes

    @property
    def name(self) -> str:
        return object_name(self.spec.name, self.job.stage.name, self.job.attempt)

    @property
    def port(self) -> int:
        """The port pod 0 listens on for the others (the c10d rendezvous)."""
        return self.kube.rdzv_port

    def selector(self) -> dict[str, str]:
        """The labels that select this launch's pods (and only them)."""
        return launch_labels(self.spec.name, self.job.stage.name, self.job.attempt)

    def labels(self) -> dict[str, str]:
        return {**self.kube.labels, **self.selector()}

    def annotations(self) -> dict[str, str]:
        return {
            **self.kube.annotations,
            f"{LABEL}/campaign": self.spec.name,
            f"{LABEL}/stage": self.job.stage.name,
            f"{LABEL}/attempt": str(self.job.attempt),
            f"{LABEL}/spec-hash": self.spec.spec_hash(),
        }

    def metadata(self, name: str) -> dict:
        return {
            "name": name,
            "namespace": self.kube.namespace,
            "labels": self.labels(),
            "annotations": self.annotations(),
        }

    def endpoint(self) -> str:
        return f"{self.host0()}:{self.port}"

    def host0(self) -> str:
        """The DNS name of pod 0 (index 0 of the Indexed Job, through the headless Service)."""
        return f"{self.name}-0.{self.name}.{self.kube.namespace}.svc"

    def threads(self) -> int:
        """torch threads per worker: the spec's, or the pod's CPUs divided among its workers."""
        c = self.spec.cluster
        return c.threads_per_worker or max(1, int(quantity_bytes(self.kube.cpu_per_node)) // c.workers_per_node)

    def command(self) -> list[str]:
        """The node agent, its node index from the Job's completion index (node 0 hosts the rendezvous;
        indices from ``nodes`` on stand by, as a local cluster's standby nodes do)."""
        c = self.spec.cluster
        agent = [
            "python",
            "-m",
            "trainer.launch",
            self.job_location,
            "--nproc",
            str(c.workers_per_node),
            "--nnodes-min",
            str(c.nodes_min),
            "--nnodes-max",
            str(self.nodes),
            "--rdzv-endpoint",
            self.endpoint(),
            "--run-id",
            f"{self.job.stage.name}-{self.job.attempt}",
            "--max-restarts",
            str(c.max_restarts),
            "--threads",
            str(self.threads()),
        ]
        standby = (
            f'standby=""; [ "$JOB_COMPLETION_INDEX" -ge {self.nodes} ] && standby=--standby; '
            if self.spare_nodes
            else ""
        )
        script = (
            f'host=""; [ "$JOB_COMPLETION_INDEX" = 0 ] && host=--rdzv-host; {standby}'
            f'exec {shlex.join(agent)} --node "$JOB_COMPLETION_INDEX" $host' + (" $standby" if standby else "")
        )
        return ["sh", "-c", script]

    def env(self) -> list[dict]:
        plain = {
            "PYTHONUNBUFFERED": "1",
            **({"MLFLOW_TRACKING_URI": self.spec.tracking.uri} if self.spec.tracking.uri else {}),
            **(STANDBY_NODE_ENV if self.spare_nodes else {}),
            **self.kube.env,
        }
        return [{"name": k, "value": v} for k, v in plain.items()] + [
            {"name": k, "valueFrom": {"secretKeyRef": {"name": ref.secret, "key": ref.key}}}
            for k, ref in self.kube.secret_env.items()
        ]

    def resources(self) -> dict:
        amounts = {"cpu": self.kube.cpu_per_node, "memory": self.kube.memory_per_node}
        if self.kube.gpus_per_node:
            amounts["nvidia.com/gpu"] = str(self.kube.gpus_per_node)
        return {"requests": dict(amounts), "limits": dict(amounts)}

    def volumes(self) -> tuple[list[dict], list[dict]]:
        need = node_shm_bytes(self.job, self.spec.cluster.workers_per_node, self.nodes)
        shm = shm_limit(self.kube, need, self.job.checkpoint.shm_fallback)
        volumes = [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm >> 20}Mi"}}]
        mounts = [{"name": "shm", "mountPath": self.job.checkpoint.shm_dir or "/dev/shm"}]
        if self.kube.workdir_claim:
            volumes.append({"name": "workdir", "persistentVolumeClaim": {"claimName": self.kube.workdir_claim}})
            mounts.append({"name": "workdir", "mountPath": str(self.spec.workdir_path)})
        return volumes, mounts

    def liveness_probe(self) -> dict:
        """The agent's liveness file (``trainer.liveness``) checked every 5 s: one older than
        ``node_silent_s`` stops the container (a file not written yet is no failure)."""
        check = (
            f'exec python -m trainer.liveness {shlex.quote(str(self.job.job_dir))} "$JOB_COMPLETION_INDEX" '
            f"{self.kube.node_silent_s}"
        )
        return {
            "exec": {"command": ["sh", "-c", check]},
            "periodSeconds": 5,
            "timeoutSeconds": 10,
            "failureThreshold": 1,
        }

    def tolerations(self) -> list[dict]:
        """The spec's tolerations, and a shorter stay on a node that stopped reporting
        (``unreachable_eviction_s``) unless they name those taints."""
        own = [{_camel(f): v for f, v in t.model_dump(exclude_none=True).items()} for t in self.kube.tolerations]
        named = {t.get("key") for t in own}
        return own + [
            {
                "key": key,
                "operator": "Exists",
                "effect": "NoExecute",
                "tolerationSeconds": self.kube.unreachable_eviction_s,
            }
            for key in UNREACHABLE_TAINTS
            if key not in named
        ]

    def service(self) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self.metadata(self.name),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": self.selector(),
                "ports": [{"name": "rdzv", "port": self.port, "targetPort": self.port, "protocol": "TCP"}],
            },
        }

    def pod_failure_policy(self) -> dict:
        """Configuration errors fail the whole Job at once; disruptions (preemption, eviction,
        node drain) do not count against any retry budget."""
        return {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": CONFIG_EXIT_CODES},
                },
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]
        }

    def job_manifest(self) -> dict:
        k = self.kube
        volumes, mounts = self.volumes()
        pod = {
            "subdomain": self.name,
            "restartPolicy": "Never",
            "volumes": volumes,
            "containers": [
                {
                    "name": CONTAINER,
                    "image": k.image,
                    "imagePullPolicy": k.image_pull_policy,
                    "command": self.command(),
                    "env": self.env(),
                    "resources": self.resources(),
                    "volumeMounts": mounts,
                    "ports": [{"name": "rdzv", "containerPort": self.port, "protocol": "TCP"}],
                }
            ],
        }
        if k.node_silent_s:
            pod["containers"][0]["livenessProbe"] = self.liveness_probe()
        optional = {
            "serviceAccountName": k.service_account_name,
            "priorityClassName": k.priority_class_name,
            "nodeSelector": dict(k.node_selector) or None,
            "imagePullSecrets": [{"name": s} for s in k.image_pull_secrets] or None,
            "tolerations": self.tolerations() or None,
        }
        pod.update({key: v for key, v in optional.items() if v is not None})
        if self.avoid_hosts:
            pod["affinity"] = avoid_hosts_affinity(self.avoid_hosts)
        pods = self.nodes + self.spare_nodes
        spec = {
            "completionMode": "Indexed",
            "completions": pods,
            "parallelism": pods,
            "backoffLimitPerIndex": 0,
            "podFailurePolicy": self.pod_failure_policy(),
            "template": {"metadata": {"labels": self.labels(), "annotations": self.annotations()}, "spec": pod},
        }
        if k.ttl_seconds_after_finished is not None:
            spec["ttlSecondsAfterFinished"] = k.ttl_seconds_after_finished
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": self.metadata(self.name), "spec": spec}

    def manifests(self) -> list[dict]:
        """Service first (its DNS name must exist before pod 0 is looked up), then the Job."""
        return [self.service(), self.job_manifest()]


def avoid_hosts_affinity(hosts: tuple[str, ...]) -> dict:
    """A required node affinity that keeps pods off the Kubernetes nodes named ``hosts``. By the
    node's name (``matchFields`` ``metadata.name``, what a pod's ``spec.nodeName`` records), not its
    ``kubernetes.io/hostname`` label, which differs from the name on some providers."""
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": sorted(set(hosts))}]}
                ]
            }
        }
    }


def stage_launch(spec: CampaignSpec, stage: str, attempt: int = 1, vocab_size: int | None = None) -> Launch:
    """The launch of ``stage`` as the backend would make it, with all ``cluster.nodes_max`` nodes and standby nodes
    (``vocab_size``: the data set's; default the spec's tokenizer size). KeyError: no such stage."""
    from pretrain.run.jobs import job_config

    if spec.cluster.kind != "kubernetes":
        raise ValueError(f"cluster.kind is {spec.cluster.kind!r}: manifests exist only for kind 'kubernetes'")
    names = [s.name for s in spec.stages]
    if stage not in names:
        raise KeyError(f"no stage {stage!r} in campaign {spec.name!r} (stages: {', '.join(names)})")
    job = job_config(spec, names.index(stage), attempt, None, vocab_size or spec.data.tokenizer.vocab_size)
    location = str(JobLayout(spec.layout.job_dir(stage, attempt)).config)
    return Launch(spec, job, location, spec.cluster.nodes_max, spare_nodes=spec.cluster.spare_nodes)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.capitalize() for w in rest)
