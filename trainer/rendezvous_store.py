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

:class:`RoundStoreAddress` wraps the handler: after every round the rank-0 node writes its
address again and every other node reads the round's, so all of a round's workers share one store.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo


class RoundStoreAddress:
    """A rendezvous handler (torch's, delegated to) that agrees on the store's address every round."""

    def __init__(self, handler: RendezvousHandler):
        self._handler = handler

    def __getattr__(self, name: str):
        return getattr(self._handler, name)

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._handler.next_rendezvous()
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
