"""The node agent, started as ``python -m trainer.launch JOB.json --nproc N ...``.

For a job of one node it runs our own agent (``trainer.agent.single_node``: worker monitoring, fast
recovery keeping the survivors of a lost worker, warm spares, full restarts); for several nodes
torch's elastic agent (the ``torchrun`` machinery: c10d rendezvous, worker monitoring, in-job
restarts). Either starts ``python -m trainer.worker JOB.json`` per local rank; around them the
checkpoint saver and the hang detector.
It exits 0 when every worker finished, 1 when the job failed after its restarts, and ends
itself (and so its workers) if the orchestrator that started it dies.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from trainer.agent.elastic import host_port, run_elastic
from trainer.agent.single_node import AgentSettings, run_local
from trainer.checkpoint import fence, shmdirs
from trainer.checkpoint.saver import ERROR_FILE, PROGRESS_FILE
from trainer.checkpoint.store import stage_store
from trainer.common.backoff import Backoff
from trainer.common.process import exit_when_orphaned
from trainer.dist import pick_backend
from trainer.job.config import JobConfig, NodeDrill
from trainer.job.drills import claim, reached_marker
from trainer.job.events import EventKind
from trainer.job.reporting import JsonLines
from trainer.liveness import NodeLiveness
from trainer.resilience.heartbeat import AdaptiveTimeout, HangDetector, worker_pids
from trainer.resilience.nodecheck import exclusion_marker
from trainer.resilience.stacks import log_on_signal
from trainer.storage.base import StorageUnreachable
from trainer.zygote.client import Zygote, spawn


class LockBusy(RuntimeError):
    pass


def hold_lock(path: Path, timeout_s: float) -> int:
    """Take an exclusive lock on ``path`` (waiting for a dying predecessor); keep the fd open."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise LockBusy(
                    f"{path} is held by another training job (pid {Path(path).read_text().strip()})"
                ) from None
            time.sleep(0.2)  # poll the lock; the holder is an orphan that exits within a second


class SaverProcess:
    """The node's checkpoint saver, kept alive for the agent's lifetime: restarted if it dies,
    after a backoff that doubles with each failure in a row (up to ``BACKOFF_CAP_S``); after
    ``max_failures`` failures in a row — none of them persisted a step — it is given up and
    ``on_give_up(message, error_type)`` is called with the saver's last error and its class.
    Failures because the storage cannot be reached (``StorageUnreachable``: S3 away for a while)
    are not counted: training goes on on its memory snapshots and the saver is restarted until
    the storage has been away ``outage_s``; then it is given up as well."""

    BACKOFF_CAP_S = 60.0

    def __init__(
        self,
        ns: Path,
        nproc: int,
        job_path: str,
        max_failures: int = 5,
        backoff_s: float = 1.0,
        on_give_up=None,
        zygote: Zygote | None = None,
        outage_s: float = 600.0,
    ):
        self.argv = ["--ns", str(ns), "--nproc", str(nproc), "--job", job_path, "--agent", str(os.getpid())]
        self.zygote = zygote
        self.ns, self.max_failures, self.on_give_up, self.outage_s = ns, max_failures, on_give_up, outage_s
        self.closing = threading.Event()
        self.restarts, self.backoff = 0, Backoff(backoff_s, self.BACKOFF_CAP_S)
        self.refusals = 0  # failures in a row other than the storage being away
        self.away_since: float | None = None  # the storage unreachable at each failure since then
        self.failed: str | None = None  # the message, once given up
        self._start()
        threading.Thread(target=self._watch, name="saver-watch", daemon=True).start()

    def _start(self) -> None:
        (self.ns / ERROR_FILE).unlink(missing_ok=True)
        self.started = time.time()
        self.proc = spawn("trainer.saver", self.argv, zygote=self.zygote)

    def _persisted_since_start(self) -> bool:
        try:
            return (self.ns / PROGRESS_FILE).stat().st_mtime >= self.started
        except FileNotFoundError:
            return False

    def last_error(self, code: int) -> tuple[str, str | None]:
        """The saver's last error and its class (None when it died without writing one: killed,
        or an exit code; or its error file is damaged, then the file's text is the error)."""
        try:
            raw = (self.ns / ERROR_FILE).read_bytes()
        except FileNotFoundError:
            return (f"exit {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"), None
        try:
            record = json.loads(raw)
            return str(record["error"]), str(record["error_type"])
        except (ValueError, TypeError, KeyError):
            return raw.decode(errors="replace").strip() or f"exit {code}", None

    def _watch(self) -> None:
        while not self.closing.is_set():
            code = self.proc.wait()
            if self.closing.is_set():
                return
            if self._persisted_since_start():  # it did its work before dying: not a failure in a row
                self.backoff.succeeded()
                self.refusals, self.away_since = 0, None
            delay = self.backoff.failed()
            error, error_type = self.last_error(code)
            if self._gives_up(error, error_type):
                if self.on_give_up is not None:
                    self.on_give_up(self.failed, error_type)
                return
            if self.away_since is not None:
                print(
                    f"checkpoint storage unreachable ({error}); training goes on on memory snapshots; restarting "
                    f"the saver in {delay:.1f} s (the job fails if the storage stays away {self.outage_s:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                print(
                    f"checkpoint saver failed ({error}); restarting it in {delay:.1f} s "
                    f"(failure {self.refusals} of {self.max_failures} in a row)",
                    file=sys.stderr,
                    flush=True,
                )
            if self.closing.wait(delay):
                return
            self.restarts += 1
            self._start()

    def _gives_up(self, error: str, error_type: str | None) -> bool:
        """Count this failure; whether it is one too many (then ``failed`` says why)."""
        if error_type == StorageUnreachable.__name__:
            self.away_since = self.away_since if self.away_since is not None else time.monotonic()
            away_s = time.monotonic() - self.away_since
            if away_s >= self.outage_s:
                self.failed = (
                    f"checkpoint storage unreachable for {away_s:.0f} s (fault_tolerance.storage_outage_s: "
                    f"{self.outage_s:.0f}); last error: {error}"
                )
            return self.failed is not None
        self.refusals, self.away_since = self.refusals + 1, None
        if self.refusals >= self.max_failures:
            self.failed = f"checkpoint saver failed {self.refusals} times in a row; last error: {error}"
        return self.failed is not None

    def close(self, timeout_s: float = 120) -> None:
        """Let the saver finish (including a save at breakpoint), then stop it."""
        self.closing.set()
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def fail_job(job: JobConfig, node: int, message: str, saver_error_type: str | None = None) -> None:
    """Record why this node fails the job, then stop the workers: torch's agent turns SIGTERM
    into its orderly shutdown, and ``main`` exits non-zero."""
    JsonLines(job.layout.events).write(
        {
            "source": "agent",
            "node": node,
            "event": EventKind.ERROR,
            "error": f"SaverFailed: {message}",
            "error_type": "SaverFailed",
            "cause_types": [saver_error_type] if saver_error_type else [],
        }
    )
    print(f"training job failed: {message}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


REMOTE_GRACE_S = 5.0  # on several nodes: the node of a hung worker kills it first (HangDetector.remote_grace_s)


def watch_workers(job: JobConfig, node: int, saver, several_nodes: bool = False) -> HangDetector:
    """Hang detection for this node's workers, and the agent-side chaos drills."""
    report, ft = agent_report(job, node), job.fault_tolerance
    detector = HangDetector(
        job.job_dir,
        ft.phase_timeouts,
        report,
        adaptive=AdaptiveTimeout(ft.hang_timeout_factor, ft.hang_timeout_floor_s, ft.hang_warmup_steps),
        remote_grace_s=REMOTE_GRACE_S if several_nodes else 0.0,
    )
    for i, drill in enumerate(job.chaos):
        if isinstance(drill, NodeDrill) and drill.node == node:
            detector.observers.append(lambda step, i=i, d=drill: agent_drill(job, i, d, step, saver(), report))
    detector.observers.append(lambda step: leave_if_excluded(job, node, report, saver()))
    return detector.start()


def agent_report(job: JobConfig, node: int):
    """How this node's agent writes an event to the job's stream."""
    events = JsonLines(job.layout.events)
    return lambda record: events.write({"source": "agent", "node": node, **record})


def stop_node(job: JobConfig, saver=None) -> None:
    """The whole node at once: workers, saver (``saver``: its SaverProcess; forked by the zygote
    it is not in this agent's process group), agent."""
    signal_node(job, signal.SIGKILL, saver)


def freeze_node(job: JobConfig, saver=None) -> None:
    """The whole node stops where it is, as a hung machine: workers, saver and agent get SIGSTOP
    (their sockets stay open, nothing exits); only the orchestrator's look at the agent's
    liveness file (``trainer.liveness``) ends it."""
    signal_node(job, signal.SIGSTOP, saver)


def signal_node(job: JobConfig, sig: int, saver=None) -> None:
    """``sig`` to this node's workers, its saver and this agent's process group, in that order."""
    for pid in worker_pids(job.job_dir):
        os.kill(pid, sig)
    if saver is not None:
        saver.proc.send_signal(sig)
    os.killpg(os.getpgid(0), sig)


def leave_if_excluded(job: JobConfig, node: int, report, saver=None) -> None:
    """The workers' node check after a restart excluded this node: stop it, so the other
    nodes' agents re-form the job without it (the orchestrator re-checks it later)."""
    if exclusion_marker(job.job_dir, node).exists():
        report({"event": EventKind.NODE_EXCLUDED, "reason": "node check after restart"})
        stop_node(job, saver)


def agent_drill(job: JobConfig, index: int, drill: NodeDrill, step: int, saver, report) -> None:
    due = step >= drill.step or reached_marker(job.job_dir, index).exists()
    if not due or not claim(job.job_dir, index):
        return
    report({"event": EventKind.CHAOS, "kind": drill.kind, "step": step})
    if drill.kind == "kill_saver" and saver is not None:
        saver.proc.kill()
    elif drill.kind == "kill_node":
        stop_node(job, saver)
    elif drill.kind == "freeze_node":
        freeze_node(job, saver)


def sweep_shared_memory(job: JobConfig, node: int) -> None:
    """Free the snapshot directories that agents killed without cleaning up left behind."""
    swept = shmdirs.sweep_orphans(job.checkpoint.shm_dir)
    if swept:
        freed = sum(size for _, size in swept)
        paths = ", ".join(str(p) for p, _ in swept)
        print(
            f"freed {freed / 2**20:.0f} MiB of shared memory left by dead agents: {paths}", file=sys.stderr, flush=True
        )
        JsonLines(job.layout.events).write(
            {
                "source": "agent",
                "node": node,
                "event": EventKind.SHM_SWEPT,
                "dirs": [str(p) for p, _ in swept],
                "bytes": freed,
            }
        )


def run_node(args: argparse.Namespace) -> int:
    """Run this node's part of the job (``args``: the command line of ``trainer.launch``); the
    agent's exit code."""
    job = JobConfig.load(args.job)
    saver: SaverProcess | None = None
    ns: Path | None = None

    def cleanup() -> None:
        if saver is not None:
            saver.close()
        if ns is not None:
            shutil.rmtree(ns, ignore_errors=True)

    exit_when_orphaned(on_orphan=cleanup)
    log_on_signal()  # kill -USR1: this agent's threads' stacks in the node's log
    liveness = NodeLiveness(job.job_dir, args.node).start()  # whoever started this node sees it is not frozen
    if args.lock:
        hold_lock(args.lock, timeout_s=args.lock_wait)
    worker_args = ["-u", "-m", "trainer.worker", args.job]
    zygote = (
        Zygote.connect(args.zygote, log=lambda line: print(line, file=sys.stderr, flush=True)) if args.zygote else None
    )
    fence.claim(stage_store(job), job.job_dir)  # savers of older jobs of this stage commit nothing from now on
    if job.checkpoint.memory_interval > 0:
        sweep_shared_memory(job, args.node)
        ns = shmdirs.create(job.checkpoint.shm_dir, job.job_dir)
        saver = SaverProcess(
            ns,
            args.nproc,
            args.job,
            job.fault_tolerance.saver_max_failures,
            job.fault_tolerance.saver_backoff_s,
            outage_s=job.fault_tolerance.storage_outage_s,
            on_give_up=lambda message, error_type: fail_job(job, args.node, message, error_type),
            zygote=zygote,
        )
        worker_args += ["--shm", str(ns)]
    detector = watch_workers(job, args.node, lambda: saver, several_nodes=args.nnodes_max > 1)
    report = agent_report(job, args.node)
    try:
        if args.nnodes_max == 1:
            code = run_local(
                local_settings(job, args, ns),
                worker_starter(zygote, worker_args[3:]),
                spares_wanted=lambda: detector.max_step >= 1,
            )
        else:
            fast = keeps_survivors(job, args.nproc * args.nnodes_max)
            code = run_elastic(
                args,
                job,
                zygote,
                worker_args,
                job.fault_tolerance.fast_recovery_timeout_s if fast else 0.0,
                spares_wanted=lambda: detector.max_step >= 1,
                before_round=lambda: leave_if_excluded(job, args.node, report, saver),
            )
    finally:
        liveness.stop()
        cleanup()
    return 1 if code and saver is not None and saver.failed else code  # fail_job reported why


def worker_starter(zygote: Zygote | None, worker_argv: list[str]):
    """How our own agent starts a worker (``extra``: more arguments, e.g. ``--spare N``; ``env``: its
    complete environment): forked from the campaign run's zygote, torch imported, else
    ``python -m trainer.worker`` in a fresh interpreter; unbuffered either way."""

    def start(extra: list[str], env: dict[str, str]):
        return spawn("trainer.worker", [*worker_argv, *extra], zygote=zygote, env={**env, "PYTHONUNBUFFERED": "1"})

    return start


def local_settings(job: JobConfig, args: argparse.Namespace, shm: Path | None = None) -> AgentSettings:
    """Our own agent's settings for a job of one node (``keeps_survivors``: the fast path)."""
    return AgentSettings(
        nproc=args.nproc,
        max_restarts=args.max_restarts,
        threads=args.threads,
        node=args.node,
        port=host_port(args.rdzv_endpoint)[1],
        spares=job.cluster.spares_per_node,
        fast=keeps_survivors(job, args.nproc),
        fast_timeout_s=job.fault_tolerance.fast_recovery_timeout_s,
        shm=None if shm is None else str(shm),
    )


def keeps_survivors(job: JobConfig, world: int) -> bool:
    """Whether the survivors of a lost worker are kept (``world``: the most workers the job has):
    under DDP over gloo with more than one worker (an FSDP model is sharded over the broken group;
    an NCCL collective with a dead peer does not fail, it waits for the group's timeout), unless
    ``fast_recovery_timeout_s`` is 0."""
    return (
        world > 1
        and job.cluster.parallelism == "ddp"
        and pick_backend(job.cluster.backend) == "gloo"
        and job.fault_tolerance.fast_recovery_timeout_s > 0
    )
