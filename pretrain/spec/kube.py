"""The ``cluster.kubernetes`` section of a campaign spec: how a stage's pods look on Kubernetes
(namespace, image, resources, scheduling, secrets by reference). The ``KubernetesCluster`` block
builds this same section, so the field definitions live here only.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from pretrain.spec.base import Section

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"  # RFC 1123 label (namespaces, object names)
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"  # RFC 1123 subdomain (secrets, priority classes, accounts)
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"  # Kubernetes quantity (no exponent form)
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
_SUFFIX = {
    "": 1,
    "m": 1e-3,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
_SECRET_WORDS = re.compile(r"(TOKEN|PASSWORD|PASSWD|SECRET|CREDENTIAL|PRIVATE|ACCESS_KEY|API_KEY)", re.I)


def quantity_bytes(quantity: str) -> int:
    """Bytes of a Kubernetes memory quantity ('16Gi', '500M', '1024'); ValueError if it is not one."""
    m = re.fullmatch(QUANTITY, quantity)
    if not m:
        raise ValueError(f"{quantity!r} is not a Kubernetes quantity (e.g. '16Gi', '512Mi', '4')")
    return int(float(quantity[: len(quantity) - len(m.group(2) or "")]) * _SUFFIX[m.group(2) or ""])


class SecretKeyRef(Section):
    """One key of a Kubernetes Secret: the pods get its value; the spec never holds it."""

    secret: str = Field(..., pattern=DNS_SUBDOMAIN, description="Name of the Secret in the training namespace.")
    key: str = Field(..., pattern=r"^[-._a-zA-Z0-9]+$", min_length=1, description="Key within the Secret.")


class Toleration(Section):
    """A Kubernetes toleration: lets the pods run on nodes with a matching taint."""

    key: str | None = Field(None, description="Taint key; empty with operator 'Exists' tolerates every taint.")
    operator: Literal["Equal", "Exists"] = Field("Equal", description="'Equal' matches `value`; 'Exists' any value.")
    value: str | None = Field(None, description="Taint value (operator 'Equal').")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect tolerated; empty: every effect."
    )
    toleration_seconds: int | None = Field(
        None, ge=0, description="With effect NoExecute: how long the pod stays bound after the taint appears."
    )


def _env_names(env: dict) -> list[str]:
    """The names of ``env``; a ValueError for one that is not an environment variable name."""
    for name in env:
        if not re.fullmatch(ENV_NAME, name):
            raise ValueError(f"{name!r} is not an environment variable name")
    return list(env)


class KubernetesSpec(Section):
    namespace: str = Field("default", pattern=DNS_LABEL, description="Namespace the training pods run in.")
    image: str = Field(
        ..., min_length=1, description="Container image with this project installed (torch, trainer package)."
    )
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = Field(
        "IfNotPresent", description="Kubernetes image pull policy of the training pods."
    )
    image_pull_secrets: list[str] = Field(
        default_factory=list, description="Names of docker-registry Secrets used to pull the image (by reference)."
    )
    service_account_name: str | None = Field(
        None,
        pattern=DNS_SUBDOMAIN,
        description="Service account of the training pods; empty uses the namespace default.",
    )
    cpu_per_node: str = Field(
        "4",
        pattern=QUANTITY,
        description="CPU request and limit of each node's pod, in Kubernetes quantity syntax (e.g. '4', '3500m').",
    )
    memory_per_node: str = Field(
        "16Gi",
        pattern=QUANTITY,
        description="Memory request and limit of each node's pod "
        "(e.g. '16Gi'); the memory-backed /dev/shm counts against it.",
    )
    gpus_per_node: int = Field(0, ge=0, description="nvidia.com/gpu resources of each node's pod; 0 trains on CPU.")
    shm_size: str = Field(
        "auto",
        description="Size of the memory-backed volume at `checkpoint.shm_dir` that holds flash checkpoint "
        "snapshots: 'auto' sizes it from the model (two slots per worker of the fullest node, plus 256 MiB for the "
        "collectives), or a quantity such as '8Gi'.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the training pods must run on."
    )
    tolerations: list[Toleration] = Field(default_factory=list, description="Taints the training pods tolerate.")
    unreachable_eviction_s: int = Field(
        30,
        ge=0,
        description="A training pod on a Kubernetes node that stopped reporting (taints "
        "node.kubernetes.io/not-ready and unreachable: the machine hung, powered off or cut off) is evicted after this "
        "many seconds, Kubernetes' default being 300: the job then counts it a lost node and can end. A toleration "
        "of yours for either taint wins.",
    )
    node_silent_s: int = Field(
        30,
        ge=0,
        description="The training container's liveness probe: a node agent that gave no sign of life (its "
        "liveness file, refreshed every second) for this long is stopped by the kubelet, and its pod counts as a lost "
        "node (a frozen agent neither exits nor closes its sockets). 0: no probe.",
    )
    priority_class_name: str | None = Field(
        None,
        pattern=DNS_SUBDOMAIN,
        description="PriorityClass of the training pods (preemption order); empty: the cluster default.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Plain environment variables of the training pods (no secrets: a name that "
        "looks like a credential is refused; use `secret_env`).",
    )
    secret_env: dict[str, SecretKeyRef] = Field(
        default_factory=dict,
        description="Environment variables taken from Kubernetes Secrets by reference, e.g. "
        "{AWS_SECRET_ACCESS_KEY: {secret: s3-creds, key: secret-key}}: the manifests name the Secret, never its value.",
    )
    workdir_claim: str | None = Field(
        None,
        pattern=DNS_SUBDOMAIN,
        description="PersistentVolumeClaim (ReadWriteMany) mounted at the campaign's "
        "workdir in every pod; empty: the workdir must be reachable otherwise (campaign state on S3).",
    )
    labels: dict[str, str] = Field(
        default_factory=dict, description="Extra labels on every object (Service, Job, pods)."
    )
    annotations: dict[str, str] = Field(default_factory=dict, description="Extra annotations on every object.")
    ttl_seconds_after_finished: int | None = Field(
        3600,
        ge=0,
        description="Kubernetes deletes a finished Job (and its pods) after this many seconds: a backstop "
        "if the backend's own teardown never runs. Empty: never.",
    )
    rdzv_port: int = Field(29400, ge=1, le=65535, description="Port of the c10d rendezvous on the pod of node 0.")

    @field_validator("shm_size")
    @classmethod
    def _shm_size(cls, size: str) -> str:
        if size != "auto":
            quantity_bytes(size)
        return size

    @field_validator("image_pull_secrets")
    @classmethod
    def _secret_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not re.fullmatch(DNS_SUBDOMAIN, name):
                raise ValueError(f"{name!r} is not a Kubernetes Secret name (lowercase letters, digits, '-', '.')")
        return names

    @field_validator("env")
    @classmethod
    def _no_secret_values(cls, env: dict[str, str]) -> dict[str, str]:
        for name in _env_names(env):
            if _SECRET_WORDS.search(name):
                raise ValueError(
                    f"{name} looks like a credential: put it in a Kubernetes Secret and refer to it in "
                    f"secret_env ({{{name}: {{secret: NAME, key: KEY}}}}); spec values are recorded in "
                    "the ledger, MLflow and the rendered manifests"
                )
        return env

    @field_validator("secret_env")
    @classmethod
    def _env_names(cls, env: dict[str, SecretKeyRef]) -> dict[str, SecretKeyRef]:
        _env_names(env)
        return env
