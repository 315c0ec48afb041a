"""``PodWatch``: the pods of one launch as the Kubernetes API last told them, kept current by a
background thread: a list first (a fresh one after ``410 Gone``), then a watch from the list's
resource version (BOOKMARKs only move the resource version). API trouble is retried, never
fatal: ``errors`` says what it was."""

from __future__ import annotations

import threading

WATCH_S = 2  # each watch request's server-side timeout: how soon the thread notices it should stop


class PodWatch:
    def __init__(self, api, namespace: str, selector: str, name: str):
        """The pods of ``namespace`` matching ``selector``; ``name``: the launch's (the thread's name)."""
        self.api, self.namespace, self.selector = api, namespace, selector
        self.errors: list[str] = []  # API trouble the watcher retried through
        self.closed = threading.Event()  # set: the watcher ends
        self._pods: dict[str, tuple[int, dict, bool]] = {}  # name → (first seen order, pod, deleted)
        self._seen = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"kube-watch-{name}", daemon=True)

    def begin(self) -> None:
        """List the pods now, then keep them current in the background."""
        self.sync()
        self._thread.start()

    def pods(self) -> list[tuple[dict, bool]]:
        """Every pod seen so far, oldest first, with whether it is gone from the API (deleted)."""
        with self._lock:
            return [(pod, deleted) for _, pod, deleted in sorted(self._pods.values(), key=lambda t: t[0])]

    def close(self) -> None:
        """End the watcher (and wait for it, unless called from it)."""
        self.closed.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(WATCH_S + 5)

    def sync(self) -> str:
        """List the launch's pods (pods gone since are deleted); returns the list's resourceVersion."""
        from kubernetes import client

        listed = client.CoreV1Api(self.api).list_namespaced_pod(self.namespace, label_selector=self.selector)
        pods = {p.metadata.name: self.api.sanitize_for_serialization(p) for p in listed.items}
        with self._lock:
            for name, (order, pod, _) in list(self._pods.items()):
                if name not in pods:
                    self._pods[name] = (order, pod, True)
            for name, pod in pods.items():
                self._put(name, pod, False)
        return listed.metadata.resource_version

    def _put(self, name: str, pod: dict, deleted: bool) -> None:
        order = self._pods[name][0] if name in self._pods else self._seen
        self._seen += 1
        self._pods[name] = (order, pod, deleted)

    def _run(self) -> None:
        from kubernetes import client

        core, version = client.CoreV1Api(self.api), None
        while not self.closed.is_set():
            try:
                version = self._follow(core, self.sync() if version is None else version)
            except client.ApiException as e:
                version = None  # 410 Gone (history compacted) or anything else: list afresh
                if e.status != 410:
                    self.errors.append(f"{e.status} {e.reason}")
                    self.closed.wait(1.0)  # back off before asking the API again
            except Exception as e:  # noqa: BLE001 — the API went away or answered garbage: retry, never die
                version = None
                self.errors.append(f"{type(e).__name__}: {e}")
                self.closed.wait(1.0)

    def _follow(self, core, version: str) -> str:
        """One watch request from ``version`` (up to ``WATCH_S``); returns the newest resource version."""
        from kubernetes import watch

        for event in watch.Watch().stream(
            core.list_namespaced_pod,
            self.namespace,
            label_selector=self.selector,
            resource_version=version,
            timeout_seconds=WATCH_S,
            allow_watch_bookmarks=True,
        ):
            if not event or event.get("type") == "BOOKMARK":
                if event and isinstance(event.get("object"), dict):
                    version = event["object"].get("metadata", {}).get("resourceVersion") or version
                continue
            pod = self.api.sanitize_for_serialization(event["object"])
            version = pod["metadata"].get("resourceVersion") or version
            with self._lock:
                self._put(pod["metadata"]["name"], pod, event["type"] == "DELETED")
            if self.closed.is_set():
                break
        return version
