"""Warm spares on a node of a job of several nodes (``trainer.agent.survivors``).

A warm spare is a worker process started ahead (``python -m trainer.worker JOB --spare N``, the
command line torch started the round's local rank 0 with): torch imported, the model built,
blocked on its key in the job's store until the node's agent hands it a lost rank
(``peers.wait_for_rank``). Under torch's agent they belong to a rendezvous round: its store
(the round's own one, with standby nodes) and its restart count go with it, so a round's spares
start ``REPLENISH_DELAY_S`` after its workers, once training is under way (not beside the
workers' start-up), and end with its workers (``stop``). Spare ids are unique among the nodes
sharing the store; each node counts its spares in its own counters (``peers.warm_key``), which a
drill's victim looks at before the drill takes it away.
"""

from __future__ import annotations

import signal
import time

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler, get_subprocess_handler

from trainer.agent.single_node import REPLENISH_DELAY_S
from trainer.dist import Identity
from trainer.resilience.peers import hand_rank, taken_key, warm_key

SPARE_IDS = 100_000  # spare ids per node: node n's spares are n × SPARE_IDS + 0, 1, …


def start_process(pc, lr: int, extra: tuple[str, ...] = ()) -> SubprocessHandler:
    """A process started as torch started local rank ``lr`` of the round ``pc`` (its process
    context), with ``extra`` arguments."""
    return get_subprocess_handler(
        entrypoint=pc.entrypoint,
        args=(*pc.args[lr], *extra),
        env=pc.envs[lr],
        stdout=pc.stdouts[lr],
        stderr=pc.stderrs[lr],
        local_rank_id=lr,
        numa_options=getattr(pc, "_numa_options", None),
    )


class WarmSpares:
    """One node's warm spares for the current round of torch's agent."""

    def __init__(self, count: int, node: int, wanted=lambda: True):
        self.count, self.node, self._wanted = count, node, wanted
        self.live: list[tuple[int, SubprocessHandler]] = []
        self._round: object | None = None  # the process context of the round they serve
        self._counted = False  # the round's counters were reset
        self._next_id, self._start_after = 0, 0.0

    def ready(self, n: int) -> bool:
        """Whether ``n`` spares can be handed over now."""
        return sum(h.proc.poll() is None for _, h in self.live) >= n

    def tend(self, pc, job_store) -> None:
        """Keep ``count`` spares for round ``pc`` (``job_store(env)``: a client of the round's store,
        None when it is unreachable)."""
        if pc is not self._round:  # a new round: the last one's spares were stopped with its workers
            self.stop()
            self._round, self._counted = pc, False
            self.replenish_later()
        self.live = [(i, h) for i, h in self.live if h.proc.poll() is None]
        if len(self.live) >= self.count or time.monotonic() < self._start_after or not self._wanted():
            return
        lr = min(pc.envs)
        store = job_store(pc.envs[lr])
        if store is None:
            return
        try:
            if not self._counted:  # the agent's store outlives rounds: the counters start anew with the spares
                store.set(warm_key(self.node), "0")
                store.set(taken_key(self.node), "0")
                self._counted = True
        except (dist.DistError, RuntimeError):
            return  # the store is away for a moment: try again at the next look
        spare = self.node * SPARE_IDS + self._next_id
        self._next_id += 1
        self.live.append((spare, start_process(pc, lr, ("--spare", str(spare)))))

    def hand_over(self, store: dist.Store, me: Identity) -> SubprocessHandler | None:
        """Hand rank ``me`` to a live spare; its process (None: no spare, start one cold)."""
        while self.live:
            spare, handler = self.live.pop(0)
            if handler.proc.poll() is None:
                hand_rank(store, spare, self.node, me)
                return handler
        return None

    def replenish_later(self) -> None:
        """The next spare starts ``REPLENISH_DELAY_S`` from now (not beside a recovery or a round's start)."""
        self._start_after = time.monotonic() + REPLENISH_DELAY_S

    def stop(self) -> None:
        for _, handler in self.live:
            handler.close(signal.SIGKILL)
        for _, handler in self.live:
            handler.proc.wait()
        self.live = []
