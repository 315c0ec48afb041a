"""Our own agent for a job of one node, in place of torch elastic's ``LocalElasticAgent``.

It does what torch's agent does for one node — host the store, start ``python -m
trainer.worker`` per local rank (RANK, WORLD_SIZE, MASTER_* in the child's ``env=``), watch
them, restart them all on a failure up to ``max_restarts`` — and what torch's agent cannot
(docs/recovery.md): when a worker dies while the others are still running, the others are kept
(``trainer.resilience.peers``). The agent announces a new epoch in its store, hands the lost
rank to a warm spare (or starts a replacement cold when none is ready), and waits for every
rank to report itself restored in the new process group. If that does not happen within
``fast_recovery_timeout_s`` (the spare or a survivor died, the survivors had nothing to roll
back to, …) it falls back to the full restart. Jobs of several nodes keep torch's agent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from trainer.checkpoint.flash import copies_in_flight
from trainer.common.process import wait_for_an_exit
from trainer.dist import EPOCH_ENV, FAST_RECOVERY_ENV, Identity
from trainer.resilience.heartbeat import AGENT_ENV
from trainer.resilience.nodecheck import NODE_ENV
from trainer.resilience.peers import PEER_LOST_EXIT, WARM_SPARES_ENV, all_ready, announce, hand_rank, not_ready
from trainer.resilience.survivor_interrupt import interrupt

POLL_S = 0.05  # how often the spares, the ranks' ready keys and snapshot copies are looked at (exits wake the agent)
STOP_GRACE_S = 30.0  # SIGTERM → SIGKILL, as torch's agent
SETTLE_S = 5.0  # the longest a full restart waits for the survivors' snapshot copies in progress
REPLENISH_DELAY_S = 2.0  # a new spare starts this long after a recovery, not beside its first steps


class Stopped(Exception):
    """The agent got SIGTERM/SIGINT: the workers are stopped, the job ends with 128 + signal."""

    def __init__(self, sig: int):
        super().__init__(f"stopped by {signal.Signals(sig).name}")
        self.sig = sig


@dataclass(frozen=True)
class AgentSettings:
    nproc: int  # workers on this node (= the world: one node)
    max_restarts: int  # recoveries (fast or full) before the job fails
    threads: int  # OMP threads per worker
    node: int  # this node's index (chaos drills, node check)
    port: int  # where the agent's store listens
    spares: int  # warm spares kept (0: a lost worker is replaced cold)
    fast: bool  # keep the survivors of a lost worker (DDP over more than one worker)
    fast_timeout_s: float  # a fast recovery not done by then falls back to a full restart
    shm: str | None = None  # the node's snapshot slots (a full restart lets copies in progress finish)


@dataclass
class Spare:
    id: int
    proc: subprocess.Popen


def describe_exit(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"


class NodeAgent:
    """Runs one node's workers (``start_worker``: starts one, see ``trainer.agent.node.worker_starter``) until they
    finish."""

    def __init__(self, settings: AgentSettings, start_worker, spares_wanted=lambda: True):
        # start_worker(extra_args, env) -> a Popen-like process (trainer.agent.node.worker_starter)
        self.s, self.start, self.spares_wanted = settings, start_worker, spares_wanted
        self.store = dist.TCPStore(
            "127.0.0.1", settings.port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self.restart = self.epoch = self.recoveries = 0
        self.workers: dict[int, subprocess.Popen] = {}
        self.spares: list[Spare] = []
        self.next_spare, self.replenish_at = 0, 0.0

    def _env(self, **extra) -> dict[str, str]:
        s = self.s
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(s.threads),
            NODE_ENV: str(s.node),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(s.port),
            "WORLD_SIZE": str(s.nproc),
            "LOCAL_WORLD_SIZE": str(s.nproc),
            "GROUP_RANK": "0",
            "TORCHELASTIC_RESTART_COUNT": str(self.restart),
            FAST_RECOVERY_ENV: str(s.fast_timeout_s if s.fast else 0),
            WARM_SPARES_ENV: str(s.spares if s.fast else 0),
            AGENT_ENV: str(os.getpid()),
        }
        return env | {k: str(v) for k, v in extra.items()}

    def _start_worker(self, rank: int) -> subprocess.Popen:
        return self.start([], self._env(RANK=rank, LOCAL_RANK=rank, **{EPOCH_ENV: self.epoch}))

    def _identity(self, rank: int) -> Identity:
        return Identity(rank, rank, self.s.nproc, self.restart, self.epoch)

    def _start_round(self) -> None:
        self.workers = {r: self._start_worker(r) for r in range(self.s.nproc)}

    def stop_workers(self, procs=None) -> None:
        """SIGTERM, then SIGKILL after ``STOP_GRACE_S`` (the saver keeps the newest snapshot)."""
        procs = [p for p in (self.workers.values() if procs is None else procs) if p.poll() is None]
        for p in procs:
            p.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def tend_spares(self) -> None:
        """Keep ``spares`` warm spares once training is under way (a spare that died is replaced)."""
        self.spares = [sp for sp in self.spares if sp.proc.poll() is None]
        if (
            not self.s.fast
            or len(self.spares) >= self.s.spares
            or time.monotonic() < self.replenish_at
            or not self.spares_wanted()
        ):
            return
        self.spares.append(Spare(self.next_spare, self.start(["--spare", str(self.next_spare)], self._env())))
        self.next_spare += 1

    def fast_recover(self, lost: list[int]) -> bool:
        """Replace the ``lost`` ranks while the others are kept; False: not done within the bound."""
        t0 = time.monotonic()
        warm = [sp for sp in self.spares if sp.proc.poll() is None][: len(lost)]
        self.spares = [sp for sp in self.spares if sp not in warm]
        path = "spare" if len(warm) == len(lost) else "replacement"  # (replacement: one or more started cold)
        self.epoch = announce(self.store, self.restart, lost, path, time.time())
        interrupt(p.pid for r, p in self.workers.items() if r not in lost and p.poll() is None)
        for rank in lost:
            if warm:
                spare = warm.pop(0)
                hand_rank(self.store, spare.id, self.s.node, self._identity(rank))
                self.workers[rank] = spare.proc
            else:
                self.workers[rank] = self._start_worker(rank)
        print(f"rank(s) {lost} lost; the other workers are kept, epoch {self.epoch}: {path}", flush=True)
        while time.monotonic() - t0 < self.s.fast_timeout_s:
            if any(p.poll() is not None for p in self.workers.values()):
                print("a worker exited during the fast recovery: restarting every worker", file=sys.stderr, flush=True)
                return False
            if all_ready(self.store, self.restart, self.epoch, self.s.nproc):
                print(f"recovered in {time.monotonic() - t0:.2f} s ({path})", flush=True)
                self.replenish_at = time.monotonic() + REPLENISH_DELAY_S
                return True
            time.sleep(POLL_S)  # polls exit codes and the ranks' ready keys
        late = not_ready(self.store, self.restart, self.epoch, self.s.nproc)
        print(
            f"the fast recovery was not done within {self.s.fast_timeout_s:.1f} s (rank(s) {late} not restored "
            "in the new process group): restarting every worker",
            file=sys.stderr,
            flush=True,
        )
        return False

    def settle_snapshots(self) -> None:
        """Let the workers still running finish the snapshot they are copying or sealing (bounded
        by ``SETTLE_S``): one stopped mid-copy would lack the newest snapshot its peers hold, and
        the restart would go back to the one before."""
        if self.s.shm is None:
            return
        deadline = time.monotonic() + SETTLE_S
        # a worker dying meanwhile leaves its copy torn for good: only the live ones are waited for
        while (
            busy := copies_in_flight(self.s.shm, {p.pid for p in self.workers.values() if p.poll() is None})
        ) and time.monotonic() < deadline:
            time.sleep(POLL_S)  # polls the slot headers and the workers
        if busy:
            print(
                f"stopping workers with snapshots still in progress after {SETTLE_S:.0f} s: {', '.join(busy)}",
                file=sys.stderr,
                flush=True,
            )

    def full_restart(self) -> None:
        self.settle_snapshots()
        self.stop_workers()
        self.restart, self.epoch = self.restart + 1, 0
        self._start_round()

    def run(self) -> int:
        """Until every worker finished (0) or the job failed after ``max_restarts`` recoveries (1)."""
        self._start_round()
        while True:
            codes = {r: p.poll() for r, p in self.workers.items()}
            if all(c == 0 for c in codes.values()):
                return 0
            failed = sorted(r for r, c in codes.items() if c not in (None, 0))
            if failed:
                why = ", ".join(f"rank {r}: {describe_exit(codes[r])}" for r in failed)
                self.recoveries += 1
                if self.recoveries > self.s.max_restarts:
                    print(
                        f"training job failed: {why} (after {self.s.max_restarts} restart(s))",
                        file=sys.stderr,
                        flush=True,
                    )
                    self.stop_workers()
                    return 1
                print(
                    f"worker failure ({why}); recovery {self.recoveries} of {self.s.max_restarts}",
                    file=sys.stderr,
                    flush=True,
                )
                survivors = [c for r, c in codes.items() if r not in failed]
                # a worker that left because a peer was lost with no recovery announced is not replaced
                fast = self.s.fast and PEER_LOST_EXIT not in (codes[r] for r in failed)
                if not (fast and survivors and all(c is None for c in survivors) and self.fast_recover(failed)):
                    self.full_restart()
            self.tend_spares()
            # woken by a worker's exit (its recovery starts at once), else every POLL_S to tend the spares
            wait_for_an_exit([p for p in self.workers.values() if p.returncode is None], POLL_S)

    def close(self) -> None:
        for sp in self.spares:
            sp.proc.kill()
        self.stop_workers()
        for sp in self.spares:
            sp.proc.wait()


def run_local(settings: AgentSettings, start_worker, spares_wanted=lambda: True) -> int:
    """Run the node's workers; the agent's exit code (0, 1, or 128 + the signal that stopped it)."""

    def stop(signum, frame):
        raise Stopped(signum)

    agent = NodeAgent(settings, start_worker, spares_wanted)
    # SIGINT left ignored when it was (a background job is not stopped by a Ctrl-C meant for others)
    previous = {
        sig: signal.signal(sig, stop)
        for sig in (signal.SIGTERM, signal.SIGINT)
        if signal.getsignal(sig) is not signal.SIG_IGN
    }
    try:
        return agent.run()
    except Stopped as err:
        print(err, file=sys.stderr, flush=True)
        return 128 + err.sig
    finally:
        for sig in previous:  # a second signal must not interrupt the shutdown
            signal.signal(sig, signal.SIG_IGN)
        agent.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
