"""Where a stage's job runs. ``Cluster.start(job) → JobHandle``; local processes implement it
here, Kubernetes Jobs in ``pretrain.cluster.kube.cluster`` (the same interface, the same elastic semantics).

Locally a *node* is one elastic agent (``python -m trainer.launch``) with its workers, in its
own process group, so a node can be stopped (or lost) as a unit.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from pretrain.cluster.ports import free_port
from pretrain.settings import PretrainSettings
from pretrain.spec.cluster import ClusterSpec
from pretrain.spec.layout import CampaignLayout
from trainer.common.process import signal_process
from trainer.job.config import STANDBY_NODE_ENV, JobConfig
from trainer.liveness import LIVENESS_INTERVAL_S, silent_for
from trainer.resilience.heartbeat import worker_pids
from trainer.resilience.nodecheck import judge_nodes
from trainer.zygote.client import Zygote, current_zygote, spawn
from trainer.zygote.process import ZygoteProcess

DONE_SILENT_S = 3 * LIVENESS_INTERVAL_S  # after the job succeeded on a node: how long another may be silent


class ClusterError(RuntimeError):
    """The cluster cannot run the job (failed health check, nothing to start)."""


class JobHandle(ABC):
    @abstractmethod
    def poll(self) -> int | None:
        """None while running; else 0 on success or the first non-zero node exit code."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> int | None:
        """Wait up to ``timeout`` seconds for the job to end; returns ``poll()``."""

    @abstractmethod
    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every process of the job (idempotent)."""

    def lost_nodes(self) -> dict[int, int]:
        """Nodes that dropped out while the job went on (index → exit code)."""
        return {}

    spare_nodes: int = (
        0  # standby nodes started with the job: a node lost while one stands by is replaced, the world kept
    )
    silent: Mapping[int, float] = MappingProxyType({})  # nodes stopped because they went silent (frozen) → seconds
    notices: tuple[
        str, ...
    ] = ()  # what start() did besides starting, for the flow run's logs (e.g. adopted a live job)

    def new_notices(self) -> list[str]:
        """What came up while the job runs that the flow run's logs should say (once each), e.g. a
        standby node that cannot run."""
        return []

    def failure_logs(self) -> dict[int, str]:
        """The ends of failed nodes' logs (index → text) for the flow run's logs; locally the
        node logs are files in the job directory already."""
        return {}


class Cluster(ABC):
    # Whether a launch outlives the orchestrator that started it, so that a re-run of a killed
    # flow process can take its live job back (``live_job``; ``start`` then adopts it) instead of
    # launching the stage's next attempt. Locally the agents die with the orchestrator: False.
    adopts_live_jobs: bool = False

    def live_job(self, stage: str, attempt: int) -> str | None:
        """The name of a live (running, not finished, not being deleted) job of launch ``attempt``
        of ``stage``, which ``start`` of that launch would adopt; None: nothing to adopt."""
        return None

    @abstractmethod
    def health_check(
        self, workdir: Path, delays: dict[int, float] | None = None, nodes: list[int] | None = None
    ) -> list[dict]:
        """One row per worker slot of ``nodes`` (default: all): node, measurements and ``ok``
        (``delays``: chaos slowdowns by rank); on Kubernetes also ``host``, the Kubernetes node the
        check ran on, which ``start(exclude=…)`` keeps the excluded nodes' pods away from."""

    @abstractmethod
    def start(
        self, job: JobConfig, job_path: Path, layout: CampaignLayout, exclude: set[int] = frozenset()
    ) -> JobHandle:
        """Start the job's nodes (all but ``exclude``); returns at once."""


@dataclass
class LocalJobHandle(JobHandle):
    """Elastic semantics: the job runs while at least ``nodes_min`` nodes do; a node that dies
    meanwhile is *lost* (the others re-rendezvous without it); the job succeeds when a node
    finishes cleanly (the orchestrator then checks the final checkpoint is committed)."""

    procs: list[subprocess.Popen | ZygoteProcess]
    logs: list[Path] = field(default_factory=list)
    nodes_min: int = 1
    nodes: list[int] | None = None  # the node index of each process (None: 0, 1, …)
    spare_nodes: int = 0
    job_dir: Path | None = None  # where the agents' liveness files are (``trainer.liveness``); None: not looked at
    silent_after_s: float = 0.0  # a running node whose agent was silent this long is stopped: lost (0: never)
    silent: dict[int, float] = field(default_factory=dict)
    _notices: list[str] = field(default_factory=list, repr=False)
    _next_look: float = field(default=0.0, repr=False)

    def lost_nodes(self) -> dict[int, int]:
        """node index → exit code of nodes that failed (or were stopped after going silent)."""
        self._stop_silent_nodes()
        return {node: p.returncode for node, p in zip(self._node_ids(), self.procs) if p.poll() not in (None, 0)}

    def _node_ids(self) -> list[int]:
        return self.nodes or list(range(len(self.procs)))

    def new_notices(self) -> list[str]:
        out, self._notices = self._notices, []
        return out

    def _stop_silent_nodes(self) -> None:
        """A frozen node neither exits nor closes its sockets: the others go on without it once the
        rendezvous drops it, and the job would wait for its exit for ever. One silent longer than
        ``silent_after_s`` (``DONE_SILENT_S`` once another node finished the job) is killed (agent,
        process group, workers): a lost node like any other."""
        if self.job_dir is None or self.silent_after_s <= 0 or time.monotonic() < self._next_look:
            return
        self._next_look = time.monotonic() + LIVENESS_INTERVAL_S
        # once a node finished the job, the others are only leaving: a few missed beats is frozen
        bound = (
            min(self.silent_after_s, DONE_SILENT_S) if any(p.poll() == 0 for p in self.procs) else self.silent_after_s
        )
        for node, proc in zip(self._node_ids(), self.procs):
            silent = silent_for(self.job_dir, node, proc.pid) if proc.poll() is None else None
            if silent is None or silent < bound:
                continue
            for pid in worker_pids(self.job_dir, proc.pid):  # forked by the zygote: not in the agent's group
                signal_process(pid, signal.SIGKILL)
            signal_process(proc.pid, signal.SIGKILL, group=True)
            proc.wait()
            self.silent[node] = round(silent, 1)
            others = any(p.poll() is None for p in self.procs)
            self._notices.append(
                f"node {node} gave no sign of life for {silent:.0f}s (frozen, or cut off): stopped it"
                + ("; the other nodes train on without it" if others else "")
            )

    def poll(self) -> int | None:
        self._stop_silent_nodes()
        codes = [p.poll() for p in self.procs]
        if any(c is None for c in codes):
            alive = sum(c in (None, 0) for c in codes)
            return None if alive >= self.nodes_min else next(c for c in codes if c not in (None, 0))
        return 0 if 0 in codes else codes[0]

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.05)  # polls child exit codes
        return code

    def stop(self, grace_s: float = 10.0) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in self.procs:
                if p.poll() is None:
                    signal_process(p.pid, sig, group=True)
            deadline = time.monotonic() + grace_s
            for p in self.procs:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            if all(p.poll() is not None for p in self.procs):
                break
        for p in self.procs:  # workers live in the agents' process groups; none may outlive them
            signal_process(p.pid, signal.SIGKILL, group=True)


@dataclass
class LocalCluster(Cluster):
    spec: ClusterSpec
    threads_per_worker: int = 1
    python: str = sys.executable
    env: Mapping[str, str] | None = field(default=None, repr=False)  # the job's environment (credentials); None: ours
    settings: PretrainSettings = field(default_factory=PretrainSettings.from_env)  # health-check timeout, lock wait
    # forks the processes with torch imported (the campaign run's, ``trainer.zygote.client``); None: fresh interpreters
    zygote: Zygote | None = field(default_factory=current_zygote, repr=False)

    def _spawn(self, module: str, argv: list[str], **kwargs) -> subprocess.Popen | ZygoteProcess:
        return spawn(module, argv, zygote=self.zygote, python=self.python, **kwargs)

    def health_check(
        self, workdir: Path, delays: dict[int, float] | None = None, nodes: list[int] | None = None
    ) -> list[dict]:
        """Every worker slot of the nodes at once: matmul time and allreduce bandwidth among them."""
        wpn, port = self.spec.workers_per_node, free_port()
        slots = [n * wpn + i for n in (range(self.spec.node_count) if nodes is None else nodes) for i in range(wpn)]
        with tempfile.TemporaryDirectory(prefix="pretrain-nodecheck-") as tmp:
            procs = []
            for k, r in enumerate(slots):
                with open(f"{tmp}/{k}.out", "wb") as out, open(f"{tmp}/{k}.err", "wb") as err:
                    procs.append(
                        self._spawn(
                            "trainer.nodecheck",
                            [
                                "--workdir",
                                str(workdir),
                                "--rank",
                                str(k),
                                "--world",
                                str(len(slots)),
                                "--master-port",
                                str(port),
                                "--extra-delay",
                                str((delays or {}).get(r, 0.0)),
                            ],
                            stdout=out,
                            stderr=err,
                            stdin=subprocess.DEVNULL,
                            env=dict(os.environ),
                        )
                    )
            rows = []
            for k, (r, proc) in enumerate(zip(slots, procs)):
                try:
                    proc.wait(self.settings.health_check_timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                row = {"node": r // wpn, "local_rank": r % wpn, "ok": proc.returncode == 0}
                if proc.returncode == 0:
                    row.update(json.loads(Path(f"{tmp}/{k}.out").read_text().strip().splitlines()[-1]))
                else:
                    row["error"] = (Path(f"{tmp}/{k}.err").read_text(errors="replace") or "no output").strip()[-2000:]
                rows.append(row)
        return rows

    def start(
        self, job: JobConfig, job_path: Path, layout: CampaignLayout, exclude: set[int] = frozenset()
    ) -> LocalJobHandle:
        endpoint = f"127.0.0.1:{free_port()}"
        # a job's own name in the rendezvous (its keys' prefix): an agent that ever reaches another
        # job's store (a port taken over between two jobs' start) is kept out of that job's rounds
        run_id = f"{job.stage.name}-{Path(job.job_dir).name}-{secrets.token_hex(4)}"
        nodes = [n for n in range(self.spec.node_count) if n not in exclude]
        if len(nodes) < self.spec.nodes_min:
            raise ClusterError(
                f"only {len(nodes)} healthy node(s) (excluded: {sorted(exclude)}), cluster.nodes_min is "
                f"{self.spec.nodes_min}: repair or replace the nodes, or lower nodes_min"
            )
        in_use = nodes[: self.spec.nodes_max]  # the rest stand by: they join the rendezvous once training runs
        env = dict(os.environ if self.env is None else self.env)
        if len(nodes) > len(in_use):
            env.update(STANDBY_NODE_ENV)
        procs, logs = [], []
        for node in nodes:
            log = job.layout.node_log(node)
            argv = (
                [
                    str(job_path),
                    "--nproc",
                    str(self.spec.workers_per_node),
                    "--nnodes-min",
                    str(self.spec.nodes_min),
                    "--nnodes-max",
                    str(len(in_use)),
                    "--rdzv-endpoint",
                    endpoint,
                    "--run-id",
                    run_id,
                    "--max-restarts",
                    str(self.spec.max_restarts),
                    "--lock",
                    str(layout.stage_lock(job.stage.name, node)),
                    "--threads",
                    str(self.threads_per_worker),
                    "--node",
                    str(node),
                    "--lock-wait",
                    str(self.settings.node_lock_wait_s),
                    "--node-timeout",
                    str(self.spec.node_timeout_s),
                ]
                + (["--rdzv-host"] if node == nodes[0] else [])
                + (["--standby"] if node not in in_use else [])
                # the agent forks its workers, spares and saver from the same zygote (torch imported)
                + (["--zygote", self.zygote.path] if self.zygote is not None and self.zygote.usable else [])
            )
            with open(log, "ab") as out:
                procs.append(
                    self._spawn(
                        "trainer.launch",
                        argv,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        new_session=True,
                        env=env,
                    )
                )
            logs.append(log)
        return LocalJobHandle(
            procs,
            logs,
            self.spec.nodes_min,
            nodes=nodes,
            spare_nodes=len(nodes) - len(in_use),
            job_dir=Path(job.job_dir),
            silent_after_s=self.settings.node_silent_s,
        )


def not_runnable(spec: ClusterSpec, env: Mapping[str, str] | None = None) -> str | None:
    """Why a campaign cannot run on this cluster (None: it can); checked before anything starts.
    A Kubernetes cluster needs an API configured in ``env`` (default: this process's)."""
    if spec.kind == "kubernetes":
        from pretrain.cluster.kube.client import KubeUnavailable, api_client

        try:
            api_client(env=env).close()
        except KubeUnavailable as e:
            return (
                f"cluster.kind 'kubernetes': {e}. Meanwhile `pretrain cluster render SPEC` shows the manifests "
                "the campaign would create"
            )
    return None


def recheck_nodes(
    cluster: Cluster, workdir: Path, nodes: list[int], baseline: list[dict], threshold: float
) -> tuple[list[int], list[dict]]:
    """Health-check nodes that were lost, against the other nodes' rows of the campaign's node
    check (``baseline``): returns the nodes fit to rejoin and their fresh rows."""
    rows = cluster.health_check(workdir, nodes=nodes)
    others = [dict(r) for r in baseline if r["node"] not in nodes]
    judged, excluded = judge_nodes([dict(r) for r in rows] + others, threshold)
    return [n for n in nodes if n not in excluded], judged[: len(rows)]
