"""Object rules of the Kubernetes API test double: the resources it serves, validation (422),
the defaults the API server fills in, and Status bodies.

The official client parses every response into strict pydantic models, so what the double
returns must be complete (see /work/shared/KUBERNETES-NOTES.md): required fields present,
integers as integers, resourceVersions and label values as strings, lists never null.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Resource:
    group: str  # "" = the core group
    version: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


RESOURCES = {
    "pods": Resource("", "v1", "Pod"),
    "services": Resource("", "v1", "Service"),
    "jobs": Resource("batch", "v1", "Job"),
    "leases": Resource("coordination.k8s.io", "v1", "Lease"),
}
KINDS = {plural: r.kind for plural, r in RESOURCES.items()}
PLURALS = {r.kind: plural for plural, r in RESOURCES.items()}
# batch/v1 Jobs deleted through the REST API orphan their pods unless told otherwise (a real trap)
DEFAULT_PROPAGATION = {"jobs": "Orphan"}

_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


class KubeError(Exception):
    """An API error answered as a ``Status`` body with its HTTP code."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def status(self) -> dict:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "details": self.details,
            "code": self.code,
        }


def invalid(plural: str, name: str, causes: list[tuple[str, str]]) -> KubeError:
    text = "; ".join(f"{field}: {msg}" for field, msg in causes)
    return KubeError(
        422,
        "Invalid",
        f'{KINDS[plural]} "{name}" is invalid: {text}',
        {
            "name": name,
            "kind": KINDS[plural],
            "causes": [{"reason": "FieldValueInvalid", "field": f, "message": m} for f, m in causes],
        },
    )


def validate(plural: str, obj: dict) -> None:
    """The checks a backend's mistakes would hit first; raises 422 Invalid naming each field."""
    meta = obj.get("metadata") or {}
    name = meta.get("name") or ""
    causes: list[tuple[str, str]] = []
    if not name:
        causes.append(("metadata.name", "Required value: name or generateName is required"))
    elif plural in ("services", "jobs") and not (len(name) <= 63 and _LABEL.match(name)):
        causes.append(("metadata.name", "a lowercase RFC 1123 label must be at most 63 characters"))
    elif not (len(name) <= 253 and _SUBDOMAIN.match(name)):
        causes.append(("metadata.name", "a lowercase RFC 1123 subdomain must be at most 253 characters"))
    for key, value in (meta.get("labels") or {}).items():
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            causes.append((f"metadata.labels[{key}]", f"invalid label value {value!r}"))
    spec = obj.get("spec") or {}
    if plural == "pods":
        causes += _pod_spec_causes("spec", spec)
    elif plural == "jobs":
        template = (spec.get("template") or {}).get("spec") or {}
        causes += _pod_spec_causes("spec.template.spec", template)
        if template.get("restartPolicy") not in ("Never", "OnFailure"):
            causes.append(("spec.template.spec.restartPolicy", 'Unsupported value: must be "Never" or "OnFailure"'))
        if spec.get("completionMode") == "Indexed" and spec.get("completions") is None:
            causes.append(("spec.completions", "Required value: when completion mode is Indexed"))
        if spec.get("podFailurePolicy") and template.get("restartPolicy") != "Never":
            causes.append(("spec.template.spec.restartPolicy", "must be Never when podFailurePolicy is set"))
        for i, rule in enumerate((spec.get("podFailurePolicy") or {}).get("rules") or []):
            if rule.get("action") not in ("FailJob", "FailIndex", "Ignore", "Count"):
                causes.append(
                    (f"spec.podFailurePolicy.rules[{i}].action", f"Unsupported value: {rule.get('action')!r}")
                )
    elif plural == "services":
        for i, port in enumerate(spec.get("ports") or []):
            if not isinstance(port.get("port"), int):
                causes.append((f"spec.ports[{i}].port", "Required value"))
    if causes:
        raise invalid(plural, name, causes)


def _pod_spec_causes(path: str, spec: dict) -> list[tuple[str, str]]:
    containers = spec.get("containers") or []
    if not containers:
        return [(f"{path}.containers", "Required value")]
    causes = []
    for i, c in enumerate(containers):
        if not c.get("name"):
            causes.append((f"{path}.containers[{i}].name", "Required value"))
        if not c.get("image"):
            causes.append((f"{path}.containers[{i}].image", "Required value"))
    return causes


def complete(plural: str, obj: dict) -> None:
    """Fill in kind/apiVersion and the defaults the API server sets at creation."""
    resource = RESOURCES[plural]
    obj["kind"], obj["apiVersion"] = resource.kind, resource.api_version
    spec = obj.setdefault("spec", {})
    if plural == "jobs":
        uid, name = obj["metadata"]["uid"], obj["metadata"]["name"]
        spec.setdefault("completionMode", "NonIndexed")
        if "parallelism" not in spec and "completions" not in spec:
            spec["completions"] = 1
        spec.setdefault("parallelism", 1)
        spec.setdefault("backoffLimit", 2147483647 if spec.get("backoffLimitPerIndex") is not None else 6)
        spec.setdefault("suspend", False)
        selector = {"batch.kubernetes.io/controller-uid": uid}
        spec.setdefault("selector", {"matchLabels": selector})
        labels = spec["template"].setdefault("metadata", {}).setdefault("labels", {})
        labels.update({**selector, "batch.kubernetes.io/job-name": name, "controller-uid": uid, "job-name": name})
        obj.setdefault("status", {})
    elif plural == "pods":
        spec.setdefault("restartPolicy", "Always")
        for c in spec["containers"]:
            c.setdefault(
                "imagePullPolicy",
                "Always" if c["image"].endswith(":latest") or ":" not in c["image"] else "IfNotPresent",
            )
        obj.setdefault("status", {"phase": "Pending", "conditions": [], "qosClass": "BestEffort"})
    elif plural == "services":
        spec.setdefault("type", "ClusterIP")
        high, low = divmod(hash(obj["metadata"]["uid"]) % 65000 + 10, 256)
        spec.setdefault("clusterIP", f"10.96.{high}.{low}")
        spec.setdefault("clusterIPs", [spec["clusterIP"]])
        for port in spec.get("ports") or []:
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port["port"])
        obj.setdefault("status", {"loadBalancer": {}})


# what a client may not change after creation (the real API answers 422 "field is immutable")
_IMMUTABLE = {
    "jobs": ("template", "selector", "completionMode", "podFailurePolicy", "backoffLimitPerIndex"),
    "services": ("clusterIP", "clusterIPs"),
}
_POD_MUTABLE = ("activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds")


def check_immutable(plural: str, old: dict, new: dict) -> None:
    """422 when a client's update changes an immutable field (controllers may, e.g. nodeName)."""
    before, after = old.get("spec") or {}, new.get("spec") or {}
    if plural == "pods":
        changed = sorted(
            k
            for k in set(before) | set(after)
            if k not in _POD_MUTABLE
            and before.get(k) != after.get(k)
            and not (k == "containers" and _images_only(before[k], after.get(k) or []))
        )
        if changed:
            raise invalid(
                plural,
                old["metadata"]["name"],
                [
                    (
                        f"spec.{changed[0]}",
                        "Forbidden: pod updates may not change "
                        "fields other than image, activeDeadlineSeconds, tolerations",
                    )
                ],
            )
        return
    for field in _IMMUTABLE.get(plural, ()):
        if before.get(field) != after.get(field):
            raise invalid(plural, old["metadata"]["name"], [(f"spec.{field}", "Invalid value: field is immutable")])


def _images_only(before: list[dict], after: list[dict]) -> bool:
    strip = lambda cs: [{k: v for k, v in c.items() if k != "image"} for c in cs]  # noqa: E731
    return strip(before) == strip(after)
