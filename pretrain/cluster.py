"""Where a stage's job runs. ``Cluster.start(job) → JobHandle``; local processes implement it
now, Kubernetes implements the same interface later.

Locally a *node* is one elastic agent (``python -m trainer.launch``) with its workers, in its
own process group, so a node can be stopped (or lost) as a unit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.layout import CampaignLayout
from pretrain.spec import ClusterSpec
from trainer.config import JobConfig


class ClusterError(RuntimeError):
    """The cluster cannot run the job (failed health check, nothing to start)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class Cluster(ABC):
    @abstractmethod
    def health_check(self, workdir: Path) -> list[dict]:
        """One row per node: measurements and ``ok``."""

    @abstractmethod
    def start(self, job: JobConfig, job_path: Path, layout: CampaignLayout) -> JobHandle:
        """Start the job's nodes; returns at once."""


@dataclass
class LocalJobHandle(JobHandle):
    procs: list[subprocess.Popen]
    logs: list[Path] = field(default_factory=list)

    def poll(self) -> int | None:
        codes = [p.poll() for p in self.procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        return 0 if all(c == 0 for c in codes) else None

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in self.procs:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                p.wait(remaining)
            except subprocess.TimeoutExpired:
                break
            if p.returncode != 0:
                break
        return self.poll()

    def stop(self, grace_s: float = 10.0) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in self.procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + grace_s
            for p in self.procs:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            if all(p.poll() is not None for p in self.procs):
                break
        for p in self.procs:  # workers live in the agents' process groups; none may outlive them
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@dataclass
class LocalCluster(Cluster):
    spec: ClusterSpec
    threads_per_worker: int = 1
    python: str = sys.executable

    def health_check(self, workdir: Path) -> list[dict]:
        rows = []
        for node in range(self.spec.nodes_max):
            proc = subprocess.run([self.python, "-m", "trainer.healthcheck", "--workdir", str(workdir)],
                                  capture_output=True, text=True, timeout=120)
            row = {"node": node, "ok": proc.returncode == 0}
            if proc.returncode == 0:
                row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
            else:
                row["error"] = proc.stderr.strip()[-2000:]
            rows.append(row)
        return rows

    def start(self, job: JobConfig, job_path: Path, layout: CampaignLayout) -> LocalJobHandle:
        endpoint = f"127.0.0.1:{free_port()}"
        run_id = f"{job.stage}-{Path(job.job_dir).name}"
        procs, logs = [], []
        for node in range(self.spec.nodes_max):
            log = Path(job.job_dir) / f"node{node}.log"
            cmd = [self.python, "-m", "trainer.launch", str(job_path), "--nproc", str(self.spec.workers_per_node),
                   "--nnodes-min", str(self.spec.nodes_min), "--nnodes-max", str(self.spec.nodes_max),
                   "--rdzv-endpoint", endpoint, "--run-id", run_id, "--max-restarts", str(self.spec.max_restarts),
                   "--lock", str(layout.stage_lock(job.stage, node)), "--threads", str(self.threads_per_worker),
                   "--node", str(node)]
            with open(log, "ab") as out:
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True))
            logs.append(log)
        return LocalJobHandle(procs, logs)


def make_cluster(spec: ClusterSpec, threads_per_worker: int = 1) -> Cluster:
    if spec.kind == "local":
        return LocalCluster(spec, threads_per_worker)
    raise ClusterError(f"cluster.kind {spec.kind!r} is not supported yet")
