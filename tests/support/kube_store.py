"""The object store of the Kubernetes API test double: objects, resourceVersions, watch history,
label/field selectors, deletion with ownerReferences (garbage collection).

Only what a training backend needs, but what it does it does like the real API server: every
write bumps one cluster-wide resourceVersion (a string on the wire), a watch sees each change
after the version it asked for exactly once, and a version older than the kept history is
``410 Expired``. Listeners (the Job controller, the pod runner) hear every change synchronously,
under the store's lock: they must only take notes or start threads, never block.
"""

from __future__ import annotations

import copy
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone

from support.kube_objects import DEFAULT_PROPAGATION, KINDS, PLURALS, KubeError, check_immutable, complete, validate


@dataclass(frozen=True)
class Event:
    """One change: ``obj`` as written (or as last seen for DELETED), ``prev`` the state before."""

    rv: int
    plural: str
    type: str
    obj: dict
    prev: dict | None


def now() -> str:
    """An RFC 3339 timestamp as the API writes them (the client parses it into a datetime)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def owner_uids(obj: dict) -> set[str]:
    return {ref["uid"] for ref in obj["metadata"].get("ownerReferences") or [] if "uid" in ref}


# ---------------------------------------------------------------- selectors

_SPLIT = re.compile(r",(?![^(]*\))")
_REQUIREMENT = re.compile(r"^(!?)([\w./-]+)(?:\s*(==|=|!=)\s*([\w.-]*)|\s+(in|notin)\s*\(([^)]*)\))?$")


def label_matcher(selector: str | None) -> Callable[[dict], bool]:
    """A predicate over label dicts for a label selector (equality, set-based and existence
    forms); a selector that does not parse is ``400 BadRequest`` as in the real API."""
    tests = []
    for part in filter(None, (p.strip() for p in _SPLIT.split(selector or ""))):
        m = _REQUIREMENT.match(part)
        if not m:
            raise KubeError(400, "BadRequest", f"unable to parse requirement: {part!r}")
        neg, key, op, value, setop, values = m.groups()
        if op:
            tests.append(lambda labels, k=key, v=value, eq=op != "!=": (labels.get(k) == v) == eq)
        elif setop:
            vals = {v.strip() for v in values.split(",")}
            tests.append(
                lambda labels, k=key, vs=vals, inn=setop == "in": (
                    (labels.get(k) in vs) if inn else (labels.get(k) not in vs)
                )
            )
        else:
            tests.append(lambda labels, k=key, has=not neg: (k in labels) == has)
    return lambda labels: all(t(labels or {}) for t in tests)


def field_matcher(selector: str | None) -> Callable[[dict], bool]:
    """Field selectors on dotted paths (``metadata.name=x``, ``status.phase!=Running``)."""
    tests = []
    for part in filter(None, (p.strip() for p in (selector or "").split(","))):
        m = re.match(r"^([\w.]+)\s*(==|=|!=)\s*(.*)$", part)
        if not m:
            raise KubeError(400, "BadRequest", f"invalid field selector: {part!r}")
        path, op, value = m.groups()
        tests.append(lambda o, p=path.split("."), v=value, eq=op != "!=": (_dig(o, p) == v) == eq)
    return lambda obj: all(t(obj) for t in tests)


def _dig(obj, path):
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return "" if obj is None else str(obj)


# ---------------------------------------------------------------- the store


class Store:
    """All objects of the double, keyed by (plural, namespace, name)."""

    def __init__(self, history: int = 1000):
        self.cond = threading.Condition(threading.RLock())
        self.rv = 100
        self.compacted = self.rv  # a watch from a version below this one has lost events: 410
        self.history = history
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.events: list[Event] = []
        self.listeners: list[Callable[[Event], None]] = []
        self.closed = False
        self.deleters: dict[str, Callable[[dict], None]] = {}  # plural -> who finishes a graceful delete

    # -- writes
    def _record(self, plural: str, type_: str, obj: dict, prev: dict | None) -> dict:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        event = Event(self.rv, plural, type_, copy.deepcopy(obj), prev)
        self.events.append(event)
        if len(self.events) > self.history:
            drop = len(self.events) - self.history
            self.compacted = self.events[drop - 1].rv
            del self.events[:drop]
        for listener in list(self.listeners):
            listener(event)
        self.cond.notify_all()
        return copy.deepcopy(obj)

    def create(self, plural: str, ns: str, body: dict) -> dict:
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        meta["namespace"] = ns
        validate(plural, obj)
        with self.cond:
            key = (plural, ns, meta["name"])
            if key in self.objects:
                raise KubeError(
                    409,
                    "AlreadyExists",
                    f'{plural} "{meta["name"]}" already exists',
                    {"name": meta["name"], "kind": plural},
                )
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=now(), generation=1)
            for stray in ("deletionTimestamp", "resourceVersion"):
                meta.pop(stray, None)
            complete(plural, obj)
            self.objects[key] = obj
            return self._record(plural, "ADDED", obj, None)

    def get(self, plural: str, ns: str, name: str) -> dict:
        with self.cond:
            return copy.deepcopy(self._get(plural, ns, name))

    def _get(self, plural: str, ns: str, name: str) -> dict:
        try:
            return self.objects[(plural, ns, name)]
        except KeyError:
            raise KubeError(404, "NotFound", f'{plural} "{name}" not found', {"name": name, "kind": plural}) from None

    def find(self, plural: str, ns: str | None, labels: str | None = None, fields: str | None = None) -> list[dict]:
        """Live objects (not copies: hold the lock) matching the selectors; ns None = all."""
        by_label, by_field = label_matcher(labels), field_matcher(fields)
        return [
            o
            for (p, n, _), o in sorted(self.objects.items())
            if p == plural and ns in (None, n) and by_label(o["metadata"].get("labels")) and by_field(o)
        ]

    def list(
        self, plural: str, ns: str | None, labels: str | None = None, fields: str | None = None
    ) -> tuple[list[dict], str]:
        with self.cond:
            return copy.deepcopy(self.find(plural, ns, labels, fields)), str(self.rv)

    def update(
        self,
        plural: str,
        ns: str,
        name: str,
        change: Callable[[dict], None],
        expect_rv: str | None = None,
        client: bool = False,
    ) -> dict:
        """Apply ``change`` to a copy of the object and write it when it changed (one event).
        ``expect_rv``: optimistic concurrency as for PUT/patch with a resourceVersion (409);
        ``client``: a request's update, held to the immutable fields (422)."""
        with self.cond:
            old = self._get(plural, ns, name)
            if expect_rv and expect_rv != old["metadata"]["resourceVersion"]:
                raise KubeError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {plural} "{name}": the object '
                    "has been modified; please apply your changes to the latest version and try again",
                    {"name": name, "kind": plural},
                )
            new = copy.deepcopy(old)
            change(new)
            meta = new["metadata"]
            for fixed in ("name", "namespace", "uid", "creationTimestamp", "resourceVersion"):
                meta[fixed] = old["metadata"][fixed]
            if new == old:
                return copy.deepcopy(old)
            if new.get("spec") != old.get("spec"):
                meta["generation"] = old["metadata"].get("generation", 1) + 1
            validate(plural, new)
            if client:
                check_immutable(plural, old, new)
            self.objects[(plural, ns, name)] = new
            result = self._record(plural, "MODIFIED", new, copy.deepcopy(old))
            if meta.get("deletionTimestamp") and not meta.get("finalizers") and plural not in self.deleters:
                self._remove(plural, ns, name)
            return result

    # -- deletion and garbage collection
    def delete(
        self, plural: str, ns: str, name: str, propagation: str | None = None, grace_seconds: int | None = None
    ) -> dict:
        """Delete like the API server: pods end gracefully (their deleter kills the process, then
        calls :meth:`remove`); ``Foreground`` keeps the owner (deletionTimestamp, finalizer
        ``foregroundDeletion``) until its dependents are gone; ``Background`` removes it and then
        its dependents; ``Orphan`` (the default for batch/v1 Jobs) leaves the dependents."""
        propagation = propagation or DEFAULT_PROPAGATION.get(plural, "Background")
        if propagation not in ("Foreground", "Background", "Orphan"):
            raise KubeError(400, "BadRequest", f"unknown propagationPolicy {propagation!r}")
        with self.cond:
            obj = self._get(plural, ns, name)
            if obj["metadata"].get("deletionTimestamp"):
                return copy.deepcopy(obj)
            uid = obj["metadata"]["uid"]
            dependents = [o for o in self.objects.values() if uid in owner_uids(o)]
            if propagation == "Orphan":
                for dep in dependents:
                    self.update(
                        _plural(dep),
                        dep["metadata"]["namespace"],
                        dep["metadata"]["name"],
                        lambda d, u=uid: d["metadata"].__setitem__(
                            "ownerReferences", [r for r in d["metadata"]["ownerReferences"] if r.get("uid") != u]
                        ),
                    )
                dependents = []
            graceful = plural in self.deleters
            if (propagation == "Foreground" and dependents) or graceful:

                def mark(o):
                    o["metadata"]["deletionTimestamp"] = now()
                    if grace_seconds is not None:
                        o["metadata"]["deletionGracePeriodSeconds"] = grace_seconds
                    if propagation == "Foreground" and dependents:
                        o["metadata"]["finalizers"] = [*o["metadata"].get("finalizers", []), "foregroundDeletion"]

                result = self.update(plural, ns, name, mark)
                for dep in dependents:
                    self.delete(_plural(dep), dep["metadata"]["namespace"], dep["metadata"]["name"], "Background")
                if graceful:
                    self.deleters[plural](copy.deepcopy(self.objects[(plural, ns, name)]))
                return result
            return self._remove(plural, ns, name)

    def remove(self, plural: str, ns: str, name: str) -> None:
        """The end of a graceful deletion (or a finalizer's release): the object goes."""
        with self.cond:
            if (plural, ns, name) in self.objects:
                self._remove(plural, ns, name)

    def _remove(self, plural: str, ns: str, name: str) -> dict:
        obj = self.objects.pop((plural, ns, name))
        result = self._record(plural, "DELETED", obj, None)
        uid = obj["metadata"]["uid"]
        for dep in [o for o in self.objects.values() if uid in owner_uids(o)]:  # the garbage collector
            self.delete(_plural(dep), dep["metadata"]["namespace"], dep["metadata"]["name"], "Background")
        for (p, n, owner_name), owner in list(self.objects.items()):  # a foreground owner whose last dependent went
            if (
                owner["metadata"]["uid"] in owner_uids(obj)
                and "foregroundDeletion" in owner["metadata"].get("finalizers", [])
                and not any(owner["metadata"]["uid"] in owner_uids(o) for o in self.objects.values())
            ):
                self._remove(p, n, owner_name)
        return result

    # -- watch
    def compact(self) -> None:
        """Forget the whole history (as etcd compaction does): older watches get 410."""
        with self.cond:
            self.compacted = self.rv
            self.events.clear()

    def watch(
        self,
        plural: str,
        ns: str | None,
        labels: str | None,
        fields: str | None,
        since: str | None,
        timeout_s: float,
        bookmarks: bool = False,
    ) -> Iterator[dict]:
        """Watch events (wire dicts) for changes after ``since``; without it, ADDED for every
        current object first. Ends at ``timeout_s`` (the server closes the stream) or on close.
        A bad selector or version raises here, before the stream starts."""
        by_label, by_field = label_matcher(labels), field_matcher(fields)
        deadline = time.monotonic() + timeout_s

        def matches(o):
            return o is not None and by_label(o["metadata"].get("labels")) and by_field(o)

        with self.cond:
            if since in (None, "", "0"):
                initial = [{"type": "ADDED", "object": copy.deepcopy(o)} for o in self.find(plural, ns, labels, fields)]
                pos = self.rv
            else:
                if not since.isdigit():
                    raise KubeError(400, "BadRequest", f"invalid resourceVersion {since!r}")
                initial, pos = [], int(since)
        return self._stream(plural, ns, matches, initial, pos, deadline, bookmarks)

    def _stream(self, plural, ns, matches, initial, pos, deadline, bookmarks) -> Iterator[dict]:
        yield from initial
        while True:
            with self.cond:
                if pos < self.compacted:
                    yield {
                        "type": "ERROR",
                        "object": {
                            "kind": "Status",
                            "apiVersion": "v1",
                            "metadata": {},
                            "status": "Failure",
                            "code": 410,
                            "reason": "Expired",
                            "message": f"too old resource version: {pos} ({self.compacted})",
                        },
                    }
                    return
                while not self.closed and self.rv <= pos and time.monotonic() < deadline:
                    self.cond.wait(max(0.0, min(1.0, deadline - time.monotonic())))
                batch = [e for e in self.events if e.rv > pos]
                if self.closed or (not batch and time.monotonic() >= deadline):
                    if bookmarks:
                        yield {
                            "type": "BOOKMARK",
                            "object": {
                                "kind": KINDS[plural],
                                "apiVersion": "v1",
                                "metadata": {"resourceVersion": str(self.rv)},
                            },
                        }
                    return
                if not batch:
                    pos = self.rv
            for e in batch:
                pos = e.rv
                if e.plural != plural or (ns is not None and e.obj["metadata"]["namespace"] != ns):
                    continue
                now_in, was_in = matches(e.obj) and e.type != "DELETED", matches(e.prev)
                if e.type == "DELETED" and matches(e.obj):
                    yield {"type": "DELETED", "object": e.obj}
                elif now_in:
                    yield {"type": "MODIFIED" if was_in else "ADDED", "object": e.obj}
                elif was_in:  # changed so that it left the selection
                    yield {"type": "DELETED", "object": e.obj}

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def _plural(obj: dict) -> str:
    return PLURALS[obj["kind"]]
