"""A pod's container as the pod runner of the Kubernetes API test double (``kube_pods``) sees
it, without its process: what the kubelet and the cluster's DNS give it before it starts, and the
entries of the pod's status that describe it.

- Command: the manifest's ``command`` + ``args``, ``$(VAR)`` expanded from the container's env as
  the kubelet does; ``python``/``python3`` map to this machine's Python (the image's Python).
- Env: a minimal base (PATH, HOME, LANG, PYTHONPATH — what the image would provide; never this
  process's whole environment), ``HOSTNAME``, then the manifest's env: values, ``fieldRef``
  (metadata.name/namespace/uid, labels/annotations, status.podIP, spec.*), ``secretKeyRef`` from
  the runner's secrets (a missing one: :class:`ConfigError`, the kubelet's waiting
  ``CreateContainerConfigError``); ``$(VAR)`` expanded from the env defined before it.
- DNS: every pod gets its own 127.x.y.z address (Linux routes all of 127/8 to loopback). Pods
  with ``hostname`` + ``subdomain`` get the address of the name ``<hostname>.<subdomain>``, so
  it is known before the pod exists. Host names ``<host>.<svc>[.<ns>[.svc[.cluster.local]]]``
  whose ``<svc>`` is a Service of the namespace (or the pod's subdomain) are rewritten to that
  address in the command, args and env values before the process starts; nothing else resolves
  them (a process that looks such a name up itself fails). Processes that bind 0.0.0.0 share
  this machine's ports with every other pod: bind the pod's own address. torch's TCPStore
  server listens on all addresses (seen: two Jobs on one rendezvous port → EADDRINUSE in one
  and the other's clients talking to the wrong store), so give each launch its own port.
- Status: conditions (a transition time kept while a condition holds) and containerStatuses.
"""

from __future__ import annotations

import copy
import os
import random
import re
import threading
from collections.abc import Callable

from support.kube_store import Store, now

BASE_ENV = ("PATH", "HOME", "LANG", "PYTHONPATH", "PREFECT_SERVER_ANALYTICS_ENABLED")
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_FIELD = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


class ConfigError(Exception):
    """What makes the kubelet answer CreateContainerConfigError."""


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: known variables replaced, ``$$`` → ``$``, others kept."""
    return _VAR.sub(lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), text)


class PodNetwork:
    """The pods' own loopback addresses, and the host names of pods rewritten to them."""

    def __init__(self, store: Store):
        self.store = store
        self.addresses: dict[tuple[str, str, str], str] = {}
        self._next = random.randrange(2, 1 << 20)  # spread over 127/8: other sessions use it too
        self._lock = threading.Lock()

    def address(self, ns: str, subdomain: str, hostname: str) -> str:
        with self._lock:
            key = (ns, subdomain, hostname)
            if key not in self.addresses:
                while self._next % 256 in (0, 255):
                    self._next += 1
                n, self._next = self._next, self._next + 1
                self.addresses[key] = f"127.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}"
            return self.addresses[key]

    def rewrite(self, ns: str, spec: dict, text: str) -> str:
        """Replace ``<host>.<svc>[.<ns>[.svc[.cluster.local]]]`` by the pod address it names."""
        services = {s["metadata"]["name"] for s in self.store.list("services", ns)[0]} | {spec.get("subdomain") or ""}
        services.discard("")
        if not services:
            return text
        names = "|".join(re.escape(s) for s in sorted(services, key=len, reverse=True))
        pattern = (
            r"(?<![\w.-])([a-z0-9](?:[-a-z0-9]*[a-z0-9])?)\.("
            + names
            + r")(?:\."
            + re.escape(ns)
            + r"(?:\.svc(?:\.cluster\.local)?)?)?(?![\w-])"
        )
        return re.sub(pattern, lambda m: self.address(ns, m[2], m[1]), text)


def container_env(
    pod: dict,
    container: dict,
    ip: str,
    hostname: str,
    secrets: dict[tuple[str, str], dict[str, str]],
    rewrite: Callable[[str, dict, str], str],
) -> dict[str, str]:
    """The container's environment (``secrets``: (namespace, name) -> data; ``rewrite``: the pod
    host names in a value to addresses, :meth:`PodNetwork.rewrite`)."""
    ns = pod["metadata"]["namespace"]
    env = {k: os.environ[k] for k in BASE_ENV if k in os.environ}
    env["HOSTNAME"] = hostname
    view = copy.deepcopy(pod)
    view.setdefault("status", {})["podIP"] = ip
    for item in container.get("env") or []:
        source = item.get("valueFrom")
        if source is None:
            env[item["name"]] = rewrite(ns, pod["spec"], expand(item.get("value", ""), env))
        elif "fieldRef" in source:
            env[item["name"]] = _field(view, source["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            value = secrets.get((ns, ref["name"]), {}).get(ref["key"])
            if value is None and not ref.get("optional"):
                raise ConfigError(f"couldn't find key {ref['key']} in Secret {ns}/{ref['name']}")
            if value is not None:
                env[item["name"]] = value
        else:
            raise ConfigError(f"env {item['name']}: the double supports value, fieldRef and secretKeyRef only")
    return env


def container_command(
    pod: dict,
    container: dict,
    env: dict[str, str],
    rewrite: Callable[[str, dict, str], str],
    executables: dict[str, str],
) -> list[str]:
    """The container's argv (``executables``: the image's programs that are this machine's)."""
    argv = [
        rewrite(pod["metadata"]["namespace"], pod["spec"], expand(a, env))
        for a in (container.get("command") or []) + (container.get("args") or [])
    ]
    if not argv:
        raise ConfigError("the double runs the manifest's command: this container has none")
    argv[0] = executables.get(argv[0], argv[0])
    return argv


def _field(pod: dict, path: str) -> str:
    m = _FIELD.match(path)
    if m:
        return (pod["metadata"].get(m[1]) or {}).get(m[2], "")
    node = pod
    for key in path.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    if node is None and path not in ("spec.nodeName", "spec.serviceAccountName"):
        raise ConfigError(f"unsupported fieldRef {path!r}")
    return "" if node is None else str(node)


def with_condition(status: dict, type_: str, value: str, reason: str, message: str = "") -> list[dict]:
    """The pod's conditions with ``type_`` set (its transition time kept when unchanged)."""
    conditions = [c for c in status.get("conditions") or [] if c["type"] != type_]
    old = next((c for c in status.get("conditions") or [] if c["type"] == type_), None)
    stamp = old["lastTransitionTime"] if old and old["status"] == value else now()
    cond = {"type": type_, "status": value, "lastTransitionTime": stamp}
    if reason:
        cond.update(reason=reason, message=message or reason)
    return conditions + [cond]


def ready_conditions(status: dict, ready: bool, reason: str) -> list[dict]:
    value = "True" if ready else "False"
    conditions = status.get("conditions") or []
    for type_, v, why in (
        ("PodScheduled", "True", ""),
        ("Initialized", "True", ""),
        ("ContainersReady", value, reason),
        ("Ready", value, reason),
    ):
        conditions = with_condition({"conditions": conditions}, type_, v, why)
    return conditions


def container_status(container: dict, state: dict, ready: bool, pid: int) -> dict:
    return {
        "name": container["name"],
        "image": container["image"],
        "imageID": f"double://{container['image']}",
        "containerID": f"double://{pid}",
        "ready": ready,
        "restartCount": 0,
        "started": "running" in state,
        "state": state,
    }
