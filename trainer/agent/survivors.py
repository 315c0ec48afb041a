"""Survivors kept on a job of several nodes: torch's elastic agent, except for a lost worker.

Torch's ``LocalElasticAgent`` restarts every worker of every node when one worker fails: its
node's agent stops the others and starts a new rendezvous round, which the other nodes' agents
see as a membership change and restart theirs. ``SurvivorsAgent`` keeps torch's agent for
everything else — rendezvous, membership (a lost node, a standby, a scale-up), the full restart
as a fallback, success and the exit barrier — and handles a worker that died while every other
worker of its node is still running as the single-node agent does (``trainer.agent.single_node``,
docs/recovery.md): it announces the next epoch in the job's store (the store the workers
share across nodes: the rendezvous store, or the round's own store hosted by rank 0 when the
job has standby nodes), starts a replacement for the lost rank in its place (the same command
line torch started, forked from the zygote when there is one), and waits until every rank of
the world — survivors on every node and the replacement — reports itself restored in the new
process group. The other nodes' agents see nothing: their workers never died.

If that is not done within ``fast_recovery_timeout_s``, the replacement or a local survivor
exits meanwhile, or the lost rank hosted the round's store, the failure goes to torch's agent
as it would have: a full restart. Fast recoveries count against ``max_restarts`` with torch's
restarts, but never change the restart count the workers' group prefix is built from (the
other nodes' agents, which did not restart, must agree on it).

The agent is launched on each node by ``trainer.agent.elastic_launch``; its client of the job's
store: ``trainer.agent.job_store``.
"""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from trainer.agent.job_store import job_store_client
from trainer.agent.node_links import LostNode
from trainer.agent.single_node import describe_exit
from trainer.agent.spares import WarmSpares, start_process
from trainer.dist import EPOCH_ENV, Identity, own_round_store, round_restart_count
from trainer.resilience.peers import NODE_LOST_PATH, PEER_LOST_EXIT, all_ready, announce, epochs_key, not_ready
from trainer.resilience.survivor_interrupt import interrupt

POLL_S = 0.05  # how often the ranks' ready keys and the local processes are looked at during a fast recovery
MEMBERSHIP_LOOK_S = 0.5  # how often a fast recovery asks the rendezvous whether another node is restarting
STORE_RETRY_S = 5.0  # a job store found unreachable is asked again after this long
LEAVE_WAIT_S = 1.0  # after telling the workers that a node is gone: how long to wait for one of them to leave


@dataclass
class FastRecovery:
    """A fast recovery under way: ``epoch`` announced in the job's ``store`` for the round's
    ``restart`` count and a world of ``world`` ranks, the lost ranks taken by ``path`` (``spare``
    or ``replacement``), since ``started`` (monotonic time, when the loss was seen)."""

    store: dist.TCPStore
    restart: int
    epoch: int
    world: int
    path: str
    started: float

    def look(self) -> tuple[bool, bool]:
        """Whether every rank reports itself restored in the new process group, and whether
        another node announced a recovery meanwhile (both False while the store is away)."""
        try:
            ready = all_ready(self.store, self.restart, self.epoch, self.world)
            concurrent = self.store.add(epochs_key(self.restart), 0) != self.epoch
        except (dist.DistError, RuntimeError):
            ready, concurrent = False, False  # the store is away for a moment: look again
        return ready, concurrent

    def not_restored(self) -> list[int]:
        """The ranks not (known to be) restored in the new process group."""
        try:
            return not_ready(self.store, self.restart, self.epoch, self.world)
        except (dist.DistError, RuntimeError):
            return list(range(self.world))  # the store is gone: none of them is known to be restored


class SurvivorsAgent(LocalElasticAgent):
    """Torch's agent for one node of the job, keeping the survivors of a lost worker."""

    def __init__(
        self,
        spec: WorkerSpec,
        fast_timeout_s: float,
        spares: int = 0,
        node: int = 0,
        spares_wanted=lambda: True,
        before_round=lambda: None,
        **kwargs,
    ):
        super().__init__(spec=spec, **kwargs)
        self.before_round = before_round  # called before this node joins a rendezvous round (it may end the node)
        self.fast_timeout_s = fast_timeout_s
        self.fast_recoveries = 0
        self._peers_store: tuple[object, dist.TCPStore] | None = None  # (the round's process context, its store)
        self._store_retry_at = 0.0  # monotonic time before which an unreachable job store is not asked again
        self.spares = WarmSpares(spares if fast_timeout_s > 0 else 0, node, spares_wanted)
        self._worker_args = spec.args

    def _start_workers(self, worker_group: WorkerGroup):
        """Torch's start of the round's workers, telling them the round's number (``--round``): the
        restart count their keys in the job's store are named by (torch's own count stays the same
        in a round that only took a node in)."""
        worker_group.spec.args = (*self._worker_args, "--round", str(self._round()))
        return super()._start_workers(worker_group)

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """Torch's rendezvous, after ``before_round()``: a node the workers' check excluded leaves
        before it joins the next round (once in, its loss would stall the round's rank assignment)."""
        self.before_round()
        super()._rendezvous(worker_group)

    def _round(self) -> int:
        return getattr(self._worker_group.spec.rdzv_handler, "round", 0)

    def _exit_barrier(self) -> None:
        """Torch's wait for the other nodes at the job's end, once this node said it finished: its
        keep-alives may lapse meanwhile, and a finished node is not a silent one."""
        record = getattr(self._worker_group.spec.rdzv_handler, "record_finished", None)
        if record is not None:
            record()
        super()._exit_barrier()

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        self.spares.stop()  # a round's spares end with its workers (the next round has a new store)
        super()._shutdown(death_sig, timeout)

    def _lost_with_survivors(self) -> dict[int, int]:
        """Local ranks that died (their exit codes) while every other local worker still runs;
        empty when nothing died, or when a worker finished or several outcomes mix (torch decides)."""
        pc = self._pcontext
        handlers, running = getattr(pc, "subprocess_handlers", None), getattr(pc, "_running_local_ranks", None)
        if not handlers or running is None:  # not torch's subprocess context: torch decides
            return {}
        codes = {lr: handlers[lr].proc.poll() for lr in running}
        lost = {lr: c for lr, c in codes.items() if c not in (None, 0)}
        if PEER_LOST_EXIT in lost.values():  # a survivor of a loss nobody recovers (a lost node): torch restarts
            return {}
        return lost if lost and all(c is None for lr, c in codes.items() if lr not in lost) else {}

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self._pcontext is not None:  # keeps none when spares_per_node is 0
            self._tend_spares()
            restart = self._restart_for_lost_nodes(worker_group)
            if restart is not None:
                return restart
        recovered = self._after_fast_recovery(worker_group) if self.fast_timeout_s > 0 else None
        if recovered is not None:
            return recovered
        return super()._monitor_workers(worker_group)

    def _tend_spares(self) -> None:
        handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
        if all(h.proc.poll() is None for h in handlers.values()):  # (a worker that ended: the round ends, and
            self.spares.tend(self._pcontext, self._job_store)  # the store its rank 0 hosted may have gone)

    def _restart_for_lost_nodes(self, worker_group: WorkerGroup) -> RunResult | None:
        """UNHEALTHY (torch's agent restarts the workers into the next round) when another node
        was lost and the workers did not leave for the next round by themselves; else None."""
        rendezvous = worker_group.spec.rdzv_handler
        stuck = [
            node
            for node in [*rendezvous.links.take_lost(), *rendezvous.take_expired()]
            if not self._node_lost(worker_group, node)
        ]
        if any(node.silent for node in stuck):  # its sockets are open: a collective with it never fails
            print(
                "the workers are stuck in a collective with the silent node: restarting them",
                file=sys.stderr,
                flush=True,
            )
            return RunResult(state=WorkerState.UNHEALTHY)
        if stuck:  # none left: not in a collective that failed (a store wait, a long step of its own)
            print(
                f"the workers did not leave within {LEAVE_WAIT_S:g} s: restarting them for the next round",
                file=sys.stderr,
                flush=True,
            )
            return RunResult(state=WorkerState.UNHEALTHY)
        return None

    def _after_fast_recovery(self, worker_group: WorkerGroup) -> RunResult | None:
        """A lost worker replaced, its survivors kept: HEALTHY; attempted and failed: FAILED (torch
        restarts every worker). None for torch's agent to decide: nothing lost with survivors, no
        attempt, or the restart budget spent by fast recoveries (torch's agent then fails the job)."""
        lost = self._lost_with_survivors()
        if not lost:
            return None
        if self._remaining_restarts - self.fast_recoveries <= 0:
            self._remaining_restarts = 0  # fast recoveries spent the budget: torch's agent fails the job
            return None
        failures = {
            worker_group.workers[lr].global_rank: ProcessFailure(
                local_rank=lr,
                pid=self._pcontext.subprocess_handlers[lr].proc.pid,
                exitcode=code,
                error_file=self._pcontext.error_files[lr],
            )
            for lr, code in lost.items()
        }
        recovered = self._recover_fast(worker_group, lost)
        if recovered is True:
            self.fast_recoveries += 1
            return RunResult(state=WorkerState.HEALTHY)
        if recovered is False:  # replacements started and failed: torch restarts every worker
            return RunResult(state=WorkerState.FAILED, failures=failures)
        return None

    def _node_lost(self, worker_group: WorkerGroup, lost: LostNode) -> bool:
        """Another node's agent is gone (``trainer.agent.node_links``) or silent (torch's rendezvous dropped
        it: ``RoundStoreAddress.take_expired``): out of the rendezvous with it, and
        the survivors told to leave for the next round now (their broken collectives would wait
        for an announcement the lost node never makes); waits (at most ``LEAVE_WAIT_S``) until a
        local worker left, so that this look at the workers already sees it. False: none left; a
        silent node's survivors are not told (they wait in a collective with it that never fails,
        its sockets being open): False at once, for the agent to restart them."""
        rendezvous = worker_group.spec.rdzv_handler
        evicted = lost.desc is not None and rendezvous.evict(lost.desc)
        how = "its keep-alives lapsed (frozen, or cut off)" if lost.silent else "its agent's link closed"
        print(
            f"node {lost.node} (rank {lost.rank} of round {self._round()}) is gone: {how}; "
            f"{'taken out of the rendezvous, ' if evicted else ''}the workers leave for a new round",
            file=sys.stderr,
            flush=True,
        )
        pc = self._pcontext
        env = pc.envs[0]
        if lost.silent:
            return False
        if own_round_store(env) and lost.rank == 0:
            return True  # the workers' store went with it: their collectives and the store fail them at once
        store = self._job_store(env)
        try:
            if store is not None:
                announce(store, self._agreed_restart(store, env), [], NODE_LOST_PATH, lost.at)
        except (dist.DistError, RuntimeError) as err:
            print(
                f"could not tell the workers ({err}): they leave after their notice window", file=sys.stderr, flush=True
            )
            return False
        deadline = time.monotonic() + LEAVE_WAIT_S
        procs = [h.proc for h in pc.subprocess_handlers.values()]
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(POLL_S / 5)  # polls the local workers' exits
        return any(p.poll() is not None for p in procs)

    def _agreed_restart(self, store: dist.TCPStore, env: dict[str, str]) -> int:
        """The restart count the round's ranks agreed on: their group prefix and epoch keys."""
        return round_restart_count(store, int(env["WORLD_SIZE"]), self._round())

    def _job_store(self, env: dict[str, str]) -> dist.TCPStore | None:
        """A client of the store this round's workers share (one per round: a round with standby
        nodes has its own store, possibly at the same address as the last round's)."""
        where = (env["MASTER_ADDR"], int(env["MASTER_PORT"]))
        if self._peers_store is None or self._peers_store[0] is not self._pcontext:
            if time.monotonic() < self._store_retry_at:
                return None  # unreachable a moment ago: not asked at every look
            try:
                store = job_store_client(*where)
            except (dist.DistError, RuntimeError) as err:
                self._store_retry_at = time.monotonic() + STORE_RETRY_S
                print(
                    f"no fast recovery: the job's store at {where[0]}:{where[1]} is not reachable ({err})",
                    file=sys.stderr,
                    flush=True,
                )
                return None
            self._peers_store = self._pcontext, store
        return self._peers_store[1]

    def _recover_fast(self, worker_group: WorkerGroup, lost: dict[int, int]) -> bool | None:
        """Replace the ``lost`` local ranks while every other worker is kept. None: not attempted
        (torch's agent restarts every worker); False: attempted and not done in time."""
        recovery = self._announce_recovery(worker_group, lost)
        if recovery is None:
            return None
        self._replace_lost(worker_group, lost, recovery)
        return self._await_restored(worker_group, recovery)

    def _announce_recovery(self, worker_group: WorkerGroup, lost: dict[int, int]) -> FastRecovery | None:
        """The next epoch announced in the job's store for the ``lost`` local ranks; None: no fast
        recovery (no survivor to keep, the round's store gone with its host, or unreachable)."""
        started, detected = time.monotonic(), time.time()
        ranks = sorted(worker_group.workers[lr].global_rank for lr in lost)
        env = self._pcontext.envs[min(lost)]
        world = int(env["WORLD_SIZE"])
        if world < 2 or (own_round_store(env) and 0 in ranks):
            return None  # no survivor to keep; or rank 0 hosted the round's store, which went with it
        store = self._job_store(env)
        if store is None:
            return None
        try:
            restart = self._agreed_restart(store, env)
            path = "spare" if self.spares.ready(len(lost)) else "replacement"
            epoch = announce(store, restart, ranks, path, detected)
        except (dist.DistError, RuntimeError) as err:
            print(f"no fast recovery: the job's store failed ({err})", file=sys.stderr, flush=True)
            return None
        return FastRecovery(store, restart, epoch, world, path, started)

    def _replace_lost(self, worker_group: WorkerGroup, lost: dict[int, int], recovery: FastRecovery) -> None:
        """Interrupt the survivors' step and put a warm spare, else a fresh replacement, in each lost
        rank's place (with the new epoch in its environment)."""
        pc, workers, epoch = self._pcontext, worker_group.workers, recovery.epoch
        interrupt(h.proc.pid for lr, h in pc.subprocess_handlers.items() if lr not in lost and h.proc.poll() is None)
        for lr in lost:
            pc.envs[lr] = {**pc.envs[lr], EPOCH_ENV: str(epoch)}
            me = Identity(workers[lr].global_rank, lr, recovery.world, recovery.restart, epoch)
            handler = self.spares.hand_over(recovery.store, me) or start_process(pc, lr)
            pc.subprocess_handlers[lr] = handler
            workers[lr].id = handler.proc.pid
        why = ", ".join(f"rank {workers[lr].global_rank}: {describe_exit(code)}" for lr, code in sorted(lost.items()))
        print(f"worker failure ({why}); the other workers are kept, epoch {epoch}: {recovery.path}", flush=True)

    def _await_restored(self, worker_group: WorkerGroup, recovery: FastRecovery) -> bool:
        """Wait (at most ``fast_timeout_s`` from the loss) until every rank of the world reports
        itself restored: True; False as soon as a local worker exits, another node restarts the job
        or announced a recovery at the same time, or at the timeout."""
        local = [h.proc for h in self._pcontext.subprocess_handlers.values()]
        rendezvous, next_look = worker_group.spec.rdzv_handler, 0.0
        while time.monotonic() - recovery.started < self.fast_timeout_s:
            if any(p.poll() is not None for p in local):
                print("a worker exited during the fast recovery: restarting every worker", file=sys.stderr, flush=True)
                return False
            if time.monotonic() >= next_look:  # another node's agent restarting (its workers gave up): join it
                next_look = time.monotonic() + MEMBERSHIP_LOOK_S
                if rendezvous.num_nodes_waiting() > 0:
                    print(
                        "another node restarts the job during the fast recovery: restarting every worker",
                        file=sys.stderr,
                        flush=True,
                    )
                    return False
            ready, concurrent = recovery.look()
            if concurrent:  # two nodes lost workers at once (or a collective hung everywhere): one round for all
                print(
                    "another node announced a recovery at the same time: restarting every worker",
                    file=sys.stderr,
                    flush=True,
                )
                return False
            if ready:
                print(f"recovered in {time.monotonic() - recovery.started:.2f} s ({recovery.path})", flush=True)
                self.spares.replenish_later()
                return True
            time.sleep(POLL_S)  # polls the local processes and the ranks' ready keys
        print(
            f"the fast recovery was not done within {self.fast_timeout_s:.1f} s (rank(s) {recovery.not_restored()} "
            "not restored in the new process group): restarting every worker",
            file=sys.stderr,
            flush=True,
        )
        return False
