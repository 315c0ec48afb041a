"""The pod runner of the Kubernetes API test double: each pod's container runs as a local process.

- The command (``command`` + ``args``), the environment (``secretKeyRef`` from
  :attr:`PodRunner.secrets`: a missing one is a waiting ``CreateContainerConfigError``), each
  pod's own 127.x.y.z address and the pod host names rewritten to it: ``kube_containers``.
- Images are not pulled; an image in :attr:`PodRunner.unpullable` fails like a missing
  one (waiting ``ErrImagePull`` then ``ImagePullBackOff``); a pod asking for a resource in
  :attr:`PodRunner.unschedulable`, or of a Job's completion index in :attr:`PodRunner.no_room_for`,
  stays Pending (PodScheduled False, reason Unschedulable);
  affinity, tolerations and node selectors are not evaluated (one node, ``spec.nodeName``
  :attr:`PodRunner.node_name`). Only the first container runs, once
  (restartPolicy is the Job controller's business; pods are never restarted in place).
- Phase and containerStatuses follow the process (Running; Succeeded/Failed with exitCode,
  reason Completed/Error/OOMKilled); deleting a pod kills its process group (SIGTERM, SIGKILL
  after the grace period, capped at :attr:`PodRunner.max_grace_s`), then the rest of its process
  tree (as a PID namespace ends with its first process); logs are the process output.
- An exec ``livenessProbe`` runs as the kubelet runs it (period, timeout, failure threshold;
  ``sh``'s ``python`` is the image's); failing, it stops the container as a deletion does, so
  it ends with 137 if it ignores SIGTERM (a stopped process) and nothing else records why.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from support.kube_containers import (
    ConfigError,
    PodNetwork,
    container_command,
    container_env,
    container_status,
    expand,
    ready_conditions,
    with_condition,
)
from support.kube_jobs import pod_index
from support.kube_objects import KubeError
from support.kube_store import Event, Store, now

__all__ = ["ConfigError", "PodRunner", "expand"]


class PodRunner:
    """Runs pods as local processes; scripted faults: :attr:`unpullable`, :attr:`unschedulable`,
    :attr:`secrets` (missing ones), :meth:`evict`, :meth:`oom_kill`; deleting a pod kills it."""

    def __init__(self, store: Store, workdir: Path, max_grace_s: float = 5.0):
        self.store = store
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.unpullable: set[str] = set()
        self.unschedulable: set[str] = set()  # resources no node has (e.g. "nvidia.com/gpu")
        self.no_room_for: set[int] = set()  # completion indices no node has room for (e.g. a Job's standby pod)
        self.node_name = "kube-double-node"  # every scheduled pod's spec.nodeName
        self.secrets: dict[tuple[str, str], dict[str, str]] = {}  # (namespace, name) -> data
        self.executables = {"python": sys.executable, "python3": sys.executable}
        self.max_grace_s = max_grace_s
        self.network = PodNetwork(store)
        self.addresses = self.network.addresses  # (namespace, subdomain, hostname) -> the pod's address
        self.pids: list[int] = []  # every process ever started (tests check none is left)
        self._procs: dict[str, subprocess.Popen] = {}
        self._finished: set[str] = set()
        self._deleting: set[str] = set()
        self._oom: set[str] = set()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        store.listeners.append(self._on_event)
        store.deleters["pods"] = self._on_delete

    # -- scripted faults and inspection
    def evict(self, ns: str, name: str) -> None:
        """The Eviction API: a DisruptionTarget condition, then a graceful delete."""

        def disrupt(pod):
            pod["status"]["conditions"] = with_condition(
                pod["status"], "DisruptionTarget", "True", "EvictionByEvictionAPI", "Eviction API: evicting"
            )

        self.store.update("pods", ns, name, disrupt)
        self.store.delete("pods", ns, name)

    def oom_kill(self, ns: str, name: str) -> None:
        """The kernel's OOM killer: SIGKILL, and the container ends with reason OOMKilled."""
        uid = self.store.get("pods", ns, name)["metadata"]["uid"]
        with self._lock:
            self._oom.add(uid)
            proc = self._procs.get(uid)
        if proc is not None:
            _kill(proc, signal.SIGKILL)

    def logs(self, pod: dict, query: dict[str, str]) -> str:
        """The process output (``tailLines`` honoured; ``follow`` answers what is there now).
        A container that never started is 400, as the kubelet answers."""
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        waiting = not statuses or statuses[0]["state"].get("waiting") is not None
        if waiting or query.get("previous") == "true":
            why = (
                "previous terminated container not found"
                if not waiting
                else "is waiting to start: "
                + (statuses[0]["state"]["waiting"]["reason"] if statuses else "ContainerCreating")
            )
            raise KubeError(
                400, "BadRequest", f'container "{pod["spec"]["containers"][0]["name"]}" in pod "{name}" {why}'
            )
        path = self.workdir / ns / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        tail = query.get("tailLines")
        lines = text.splitlines(keepends=True)
        return "".join(lines[max(0, len(lines) - int(tail)) :]) if tail else text

    def address(self, ns: str, subdomain: str, hostname: str) -> str:
        return self.network.address(ns, subdomain, hostname)

    # -- lifecycle
    def _on_event(self, e: Event) -> None:
        if e.plural == "pods" and e.type == "ADDED" and not self._closed:
            self._spawn(self._run, e.obj)

    def _on_delete(self, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        grace = min(self.max_grace_s, pod["metadata"].get("deletionGracePeriodSeconds", 30))
        with self._lock:
            self._deleting.add(uid)
            proc = self._procs.get(uid)
            running = proc is not None and uid not in self._finished
        if running:
            self._spawn(self._stop, proc, grace)
        else:  # never started, waiting, or done: nothing to kill (a starting one sees _deleting)
            self._spawn(self.store.remove, "pods", pod["metadata"]["namespace"], pod["metadata"]["name"])

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _stop(self, proc: subprocess.Popen, grace: float) -> None:
        """SIGTERM to the container's process group, SIGKILL after ``grace``; then the rest of
        the container (processes in sessions of their own, e.g. torch's workers) goes, as the
        kernel ends a PID namespace whose first process ended."""
        rest = _descendants(proc)
        _kill(proc, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            _kill(proc, signal.SIGKILL)
        for p in rest:
            with contextlib.suppress(psutil.Error):
                p.kill()

    def _run(self, pod: dict) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        container = spec["containers"][0]
        try:
            if not self._scheduled(pod, container) or not self._pulled(pod, container):
                return
            hostname = spec.get("hostname") or name
            ip = self.address(ns, spec.get("subdomain") or "", hostname)
            try:
                env = container_env(pod, container, ip, hostname, self.secrets, self.network.rewrite)
                argv = container_command(pod, container, env, self.network.rewrite, self.executables)
            except ConfigError as e:
                self._waiting(pod, "CreateContainerConfigError", str(e))
                return
            log = self.workdir / ns / f"{name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            proc, failure = self._start(uid, argv, env, container, log)
            if failure is not None:
                self._terminated(pod, container, ip, 128, "StartError", failure, now())
            if proc is None:
                return
            started = self._running(pod, container, ip, proc)
            probe = container.get("livenessProbe") or {}
            if "exec" in probe:
                grace = min(self.max_grace_s, spec.get("terminationGracePeriodSeconds", 30))
                self._spawn(self._probe, proc, probe, env, log.parent, grace)
            code = proc.wait()
            with self._lock:
                oom = uid in self._oom
            code = 128 - code if code < 0 else code
            reason = "OOMKilled" if oom else "Completed" if code == 0 else "Error"
            self._terminated(pod, container, ip, code, reason, None, started, proc.pid)
        except KubeError:  # the pod was removed meanwhile
            pass
        finally:
            with self._lock:
                self._finished.add(uid)
                gone = uid in self._deleting
            if gone:
                self.store.remove("pods", ns, name)

    def _scheduled(self, pod: dict, container: dict) -> bool:
        """The pod on the node (``spec.nodeName``), or left Pending as Unschedulable (False)."""
        wanted = {r for part in ("requests", "limits") for r in ((container.get("resources") or {}).get(part) or {})}
        short = sorted(wanted & self.unschedulable)
        if not short and pod_index(pod) in self.no_room_for:
            short = ["cpu"]
        if short:
            message = f"0/1 nodes are available: 1 Insufficient {short[0]}."
            self._set(
                pod,
                lambda s: s.update(conditions=with_condition(s, "PodScheduled", "False", "Unschedulable", message)),
            )
            return False
        meta = pod["metadata"]
        self.store.update(
            "pods", meta["namespace"], meta["name"], lambda p: p["spec"].__setitem__("nodeName", self.node_name)
        )
        return True

    def _pulled(self, pod: dict, container: dict) -> bool:
        """The image is there, or the container waits for a pull that cannot succeed (False)."""
        image = container["image"]
        if image not in self.unpullable:
            return True
        self._waiting(pod, "ErrImagePull", f'failed to pull and unpack image "{image}": not found')
        self._waiting(pod, "ImagePullBackOff", f'Back-off pulling image "{image}"')
        return False

    def _start(
        self, uid: str, argv: list[str], env: dict[str, str], container: dict, log: Path
    ) -> tuple[subprocess.Popen | None, str | None]:
        """The container's process, or why it could not start; neither for a pod being deleted."""
        with self._lock, open(log, "wb") as out:
            if uid in self._deleting or self._closed:
                return None, None
            try:
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=container.get("workingDir") or log.parent,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            except OSError as e:
                return None, str(e)
            self._procs[uid] = proc
            self.pids.append(proc.pid)
            return proc, None

    def _running(self, pod: dict, container: dict, ip: str, proc: subprocess.Popen) -> str:
        """The pod's status once its process runs; the time it started."""
        started = now()
        self._set(
            pod,
            lambda s: s.update(
                phase="Running",
                podIP=ip,
                podIPs=[{"ip": ip}],
                hostIP="127.0.0.1",
                hostIPs=[{"ip": "127.0.0.1"}],
                startTime=started,
                conditions=ready_conditions(s, True, ""),
                containerStatuses=[container_status(container, {"running": {"startedAt": started}}, True, proc.pid)],
            ),
        )
        return started

    def _probe(self, proc: subprocess.Popen, probe: dict, env: dict[str, str], cwd: Path, grace: float) -> None:
        """The kubelet's exec liveness probe: its command every ``periodSeconds`` (after
        ``initialDelaySeconds``) in the container's environment; a run that fails or outlasts
        ``timeoutSeconds`` is a failure, and ``failureThreshold`` of them in a row stop the
        container as a deletion does (SIGTERM, SIGKILL after the grace period)."""
        argv = list(probe["exec"]["command"])
        argv[0] = self.executables.get(argv[0], argv[0])
        failures, wait = 0, probe.get("initialDelaySeconds", 0)
        while not self._closed:
            try:
                proc.wait(wait)
                return  # the container ended
            except subprocess.TimeoutExpired:
                wait = probe.get("periodSeconds", 10)
            try:
                ok = (
                    subprocess.run(
                        argv,
                        env=env,
                        cwd=cwd,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        timeout=probe.get("timeoutSeconds", 1),
                    ).returncode
                    == 0
                )
            except subprocess.TimeoutExpired:
                ok = False
            failures = 0 if ok else failures + 1
            if failures >= probe.get("failureThreshold", 3):
                self._stop(proc, grace)
                return

    def _terminated(self, pod, container, ip, code, reason, message, started, pid=0) -> None:
        state = {
            "terminated": {
                "exitCode": code,
                "reason": reason,
                "startedAt": started,
                "finishedAt": now(),
                "containerID": f"double://{pid}",
                **({"message": message} if message else {}),
            }
        }
        self._set(
            pod,
            lambda s: s.update(
                phase="Succeeded" if code == 0 else "Failed",
                podIP=ip,
                podIPs=[{"ip": ip}],
                conditions=ready_conditions(s, False, "PodCompleted"),
                containerStatuses=[container_status(container, state, False, pid)],
            ),
        )

    def _waiting(self, pod: dict, reason: str, message: str) -> None:
        container = pod["spec"]["containers"][0]
        self._set(
            pod,
            lambda s: s.update(
                conditions=ready_conditions(s, False, "ContainersNotReady"),
                containerStatuses=[
                    container_status(container, {"waiting": {"reason": reason, "message": message}}, False, 0)
                ],
            ),
        )

    def _set(self, pod: dict, change) -> None:
        self.store.update(
            "pods", pod["metadata"]["namespace"], pod["metadata"]["name"], lambda p: change(p.setdefault("status", {}))
        )

    def close(self) -> None:
        """Kill every pod's processes (its group and the rest of its tree) and wait for the
        runner's threads."""
        with self._lock:
            self._closed = True
            procs = list(self._procs.values())
        rest = [p for proc in procs if proc.poll() is None for p in _descendants(proc)]
        for proc in procs:
            _kill(proc, signal.SIGKILL)
        for p in rest:
            with contextlib.suppress(psutil.Error):
                p.kill()
        for proc in procs:
            proc.wait()
        for thread in list(self._threads):
            thread.join(10)


def _descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return []


def _kill(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
