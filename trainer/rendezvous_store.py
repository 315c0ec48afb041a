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
every node reads the number (``round``), and the workers name their keys by it.
"""

from __future__ import annotations

import sys
import time

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo


ROUNDS_KEY = "pretrain/rounds"  # the counter, in the rendezvous's store (outside any round's prefix)
ROUND_KEY = "pretrain/round"  # the round's number, in the round's part of it


class RoundStoreAddress:
    """A rendezvous handler (torch's, delegated to) that agrees on the store's address and on the
    round's number (``round``) every round."""

    def __init__(self, handler: RendezvousHandler):
        self._handler = handler
        self.round = 0  # the last round's number, the same on every node

    def __getattr__(self, name: str):
        return getattr(self._handler, name)

    def next_rendezvous(self) -> RendezvousInfo:
        asked = time.time()
        info = self._handler.next_rendezvous()
        agreed = self._agree(info)
        print(f"{time.strftime('%H:%M:%S', time.localtime(asked))} rendezvous: round {self.round}, this node rank "
              f"{info.rank} of {info.world_size} node(s), formed after {time.time() - asked:.1f} s",
              file=sys.stderr, flush=True)
        return agreed

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
