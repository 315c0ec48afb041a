"""The job's store address in every rendezvous round, whichever nodes joined when.

With torch's c10d rendezvous and the agent's store shared with the workers (the default), the
rank-0 node's agent hosts the store and writes its address (``MASTER_ADDR``/``MASTER_PORT``) into
the round's part of the rendezvous store; the other nodes read it there. Torch's handler does
this only in the first round a node joins (and when a node first becomes rank 0), and keeps the
address for later rounds (torch 2.13, ``DynamicRendezvousHandler.next_rendezvous``). So:

- a node that joins a running job (it came up after the first round closed without it: a slow
  start on a loaded machine, ``last_call_timeout`` spent) waits for an address the rank-0 node
  never writes again, and both time out after a minute;
- a node that was rank 0 in an earlier round and is not any more keeps its own address: its
  workers meet in a different store from the others' (each side waits for the other's ranks).

And a round that only takes a node in (no worker failed) keeps torch's restart count, which names
the workers' keys in that store (their process group's prefix, the fast recoveries' epochs): the
new round's workers would read the last round's keys (a process group that hangs in its set-up).

:class:`RoundStoreAddress` wraps the handler: after every round the rank-0 node writes its
address again and every other node reads the round's, so all of a round's workers share one
store; and the rank-0 node numbers the round (0, 1, … from a counter in the rendezvous's store),
every node reads the number (``round``), and the workers name their keys by it. It also links
the round's node agents (``trainer.agent.node_links``) and takes a node whose agent is gone out of the
rendezvous at once (``evict``) instead of after its keep-alives lapse, and records it lost, so
that the next round closes as soon as every other node of this one is back
(``trainer.agent.rendezvous_close``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousHandler, RendezvousInfo, RendezvousStoreInfo

from trainer.agent.node_links import LINKS_KEY, LostNode, NodeLinks
from trainer.agent.rendezvous_close import EXPIRED, CloseWhenBack, lost_from, members, record_lost

ROUNDS_KEY = "pretrain/rounds"  # the counter, in the rendezvous's store (outside any round's prefix)
ROUND_KEY = "pretrain/round"  # the round's number, in the round's part of it
FINISHED_KEY = "pretrain/finished"  # + /<round>/<node identity>: the node's workers finished the job
EXPIRED_LOOK_S = 0.2  # how often an agent looks for nodes of its round that the rendezvous dropped
EVICT_TRIES = 5  # compare-and-set attempts to write the rendezvous state without a lost node (others write it too)


class RoundStoreAddress:
    """A rendezvous handler (torch's, delegated to) that agrees on the store's address and on the
    round's number (``round``) every round."""

    def __init__(self, handler: RendezvousHandler, links: NodeLinks | None = None):
        self._handler = handler
        self.round = 0  # the last round's number, the same on every node
        self.links = links or NodeLinks()
        self._store = None  # the rendezvous's store (all rounds'), once a round formed
        self._closes = False  # whether this agent closes the next round early (``CloseWhenBack``)
        self._ranks: dict[tuple, int] = {}  # the last round's nodes (torch's identities) → their ranks
        self._round_store = None  # the last round's part of the store (the agents' links: their node numbers)
        self._expired_seen: set[tuple] = set()  # nodes of the last round already reported dropped
        self._next_expired_look = 0.0

    def __getattr__(self, name: str):
        return getattr(self._handler, name)

    def next_rendezvous(self) -> RendezvousInfo:
        asked = time.time()
        store, last_round = self._store, self.round
        # (the last round's rank 0 and the agents that found a node lost: a few per job, not every agent)
        lost = lambda: lost_from(store, last_round) | lost_from(store, EXPIRED)  # noqa: E731 - read on every look
        last = frozenset(self._ranks)
        closer = (
            CloseWhenBack(self._handler, last, lost)
            if store is not None and last and (self._closes or self._expired_of_last(store))
            else None
        )
        try:
            info = self._handler.next_rendezvous()
        finally:
            if closer is not None:
                closer.stop()
        self._ranks = members(self._handler)
        self._store, self._closes = info.store.underlying_store, info.rank == 0
        agreed = self._agree(info)
        self._round_store, self._expired_seen = agreed.store, set()
        print(
            f"{time.strftime('%H:%M:%S', time.localtime(asked))} rendezvous: round {self.round}, this node rank "
            f"{info.rank} of {info.world_size} node(s), formed after {time.time() - asked:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        self.links.join_round(agreed.store, agreed.rank, agreed.world_size, self._node_desc())
        return agreed

    def _expired_of_last(self, store) -> set[tuple]:
        """The nodes of the last round recorded dropped by torch (their keep-alives lapsed); any:
        this agent closes the next round early too (the last round's rank 0 may be one of them).
        Empty while the store cannot be read."""
        try:
            return self._ranks.keys() & lost_from(store, EXPIRED)
        except (dist.DistError, RuntimeError):
            return set()

    def take_expired(self) -> list[LostNode]:
        """The nodes of the last round that torch's rendezvous dropped since the last call (their
        keep-alives lapsed: frozen, powered off, cut off; recorded by ``record_expired_nodes``,
        in whichever agent's look dropped them), except those already found through their links
        and those that finished the job (``record_finished``: waiting for the others, they may send
        no keep-alive).
        The store is looked at every ``EXPIRED_LOOK_S`` at most."""
        now = time.monotonic()
        if self._store is None or now < self._next_expired_look:
            return []
        self._next_expired_look = now + EXPIRED_LOOK_S
        gone = self._expired_of_last(self._store) - self._expired_seen
        if not gone:
            return []
        try:
            gone = {
                d for d in gone - lost_from(self._store, self.round) if not self._store.check([self._finished_key(d)])
            }  # at the job's end: not silent
        except (dist.DistError, RuntimeError):
            return []  # the store is away for a moment: the next look
        self._expired_seen |= gone
        return [
            LostNode(self._ranks[d], self._node_of(self._ranks[d]), d, time.time(), silent=True) for d in sorted(gone)
        ]

    def record_finished(self) -> None:
        """Note in the rendezvous's store that this node's workers finished the job."""
        desc = self._node_desc()
        try:
            if self._store is not None and desc is not None:
                self._store.set(self._finished_key(desc), "1")
        except (dist.DistError, RuntimeError) as err:
            print(f"could not record that this node finished ({err})", file=sys.stderr, flush=True)

    def _finished_key(self, desc: tuple) -> str:
        return f"{FINISHED_KEY}/{self.round}/{':'.join(map(str, desc))}"

    def _node_of(self, rank: int) -> int:
        """The node number of the last round's ``rank`` (its links' record; -1 if unknown)."""
        key = f"{LINKS_KEY}/{rank}"
        try:
            return int(json.loads(self._round_store.get(key))["node"]) if self._round_store.check([key]) else -1
        except (dist.DistError, RuntimeError, ValueError, KeyError, TypeError):
            return -1

    def _node_desc(self) -> tuple | None:
        """This node's identity in torch's rendezvous state (a private part of its handler)."""
        node = getattr(self._handler, "_this_node", None)
        return dataclasses.astuple(node) if dataclasses.is_dataclass(node) else None

    def evict(self, desc: tuple) -> bool:
        """Take the node ``desc`` (``_node_desc`` of its agent) out of the rendezvous now, as torch
        does once its keep-alives lapse: its last keep-alive is written back a day older, and every
        node's next look at the state removes it. Through torch's private state holder (checked
        by ``tests/scenarios/test_node_links.py`` against this torch); False where that is not possible."""
        holder, lock = getattr(self._handler, "_state_holder", None), getattr(self._handler, "_heartbeat_lock", None)
        if holder is None or lock is None:
            return False
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

        node = _NodeDesc(*desc)
        self._record_lost(desc)
        try:
            with lock:  # the keep-alive thread syncs the same holder
                for _ in range(EVICT_TRIES):
                    holder.sync()
                    beats = holder.state.last_heartbeats
                    if node not in beats:
                        return True
                    beats[node] = beats[node] - timedelta(days=1)
                    holder.mark_dirty()
                    if holder.sync():
                        return True
        except (RendezvousError, RuntimeError, OSError) as err:
            print(
                f"could not take the lost node out of the rendezvous ({type(err).__name__}: {err}): it leaves once "
                "its keep-alives lapse",
                file=sys.stderr,
                flush=True,
            )
        return False

    def _record_lost(self, desc: tuple) -> None:
        try:
            if self._store is not None:
                record_lost(self._store, self.round, desc)
                self._closes = True
        except (dist.DistError, RuntimeError, OSError) as err:
            print(
                f"could not record the lost node ({type(err).__name__}: {err}): the next round waits for its last call",
                file=sys.stderr,
                flush=True,
            )

    def _agree(self, info: RendezvousInfo) -> RendezvousInfo:
        if info.rank == 0:  # the round's prefixed store: its underlying one is the rendezvous's, shared by all rounds
            self.round = info.store.underlying_store.add(ROUNDS_KEY, 1) - 1
            info.store.set(ROUND_KEY, str(self.round))
        else:
            self.round = int(info.store.get(ROUND_KEY))
        if not self._handler.use_agent_store:  # every round builds its own address already
            return info
        where = info.bootstrap_store_info
        if info.rank == 0:  # the rank-0 node hosts the store its handler reports
            info.store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, where.master_addr.encode())
            info.store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(where.master_port).encode())
            return info
        addr = info.store.get(RendezvousStoreInfo.MASTER_ADDR_KEY).decode()
        port = int(info.store.get(RendezvousStoreInfo.MASTER_PORT_KEY).decode())
        return RendezvousInfo(info.store, info.rank, info.world_size, RendezvousStoreInfo(addr, port))
