"""A round that re-forms after a lost node closes as soon as every other node of the last round is
back, instead of after torch's last call.

Torch's c10d rendezvous closes a round that has ``min_nodes`` but fewer than ``max_nodes``
participants only when its *last call* (5 s here: ``trainer.agent.elastic.rendezvous_configs``) for
late joiners has passed. After a lost node with no standby to take its place, that wait is most of
the recovery (the survivors are all back in ~0.1 s; the round has no one else to wait for). A
node's loss found through the agents' links (``trainer.agent.node_links``) is recorded in the
rendezvous's store for the round it was lost from (``record_lost``); while the next round forms,
the last round's rank 0 and the agents that found a node lost (a few per job, whatever its size:
each look reads the whole state) watch the rendezvous state (``CloseWhenBack``) and move the
round's deadline to now once

- every node of the last round is a participant again, except the nodes recorded lost, and
- every node the rendezvous knows (its keep-alives: waiting, standing by, or not yet timed out)
  is a participant too

— so no node that is on its way is left out: a survivor between leaving the last round and
joining the next is still expected. A node whose sockets stay open (a machine powered off, cut
off by the network, its agent frozen) closes no link; once its keep-alives lapse, torch's
rendezvous drops it from its state, and the agent whose look did so records it (``EXPIRED``,
``record_expired_nodes``): the round does not wait for it either. A node dropped by torch never
comes back under the same identity (its agent's process id is part of it). The deadline is
written with the same compare-and-set as every change to torch's rendezvous state, through a
state holder of its own (torch's private ``_BackendRendezvousStateHolder``: checked against this
torch by ``tests/scenarios/test_node_links.py``); a torch without it keeps its last call.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
from datetime import datetime, timezone

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousError

LOST_KEY = "pretrain/lost"  # + /<round>/count and /<round>/<i>: the nodes lost from a round (their rendezvous identity)
POLL_S = 0.1  # how often the rendezvous state is looked at while a round forms (as torch's own look, patched)
EXPIRED = "expired"  # in place of a round: the nodes whose keep-alives lapsed, in any round of the job


def record_lost(store: dist.Store, round_: int | str, desc: tuple) -> None:
    """Note in the rendezvous's ``store`` that node ``desc`` (its rendezvous identity) was lost
    from round ``round_`` (``EXPIRED``: torch dropped it, its keep-alives lapsed): the next round
    does not wait for it."""
    i = store.add(f"{LOST_KEY}/{round_}/count", 1) - 1
    store.set(f"{LOST_KEY}/{round_}/{i}", json.dumps(list(desc)))


def lost_from(store: dist.Store, round_: int | str) -> set[tuple]:
    """The nodes recorded lost from round ``round_`` (or ``EXPIRED``; a record that cannot be read,
    or is not written yet, is skipped: the round waits for that node as torch would)."""
    out = set()
    for i in range(store.add(f"{LOST_KEY}/{round_}/count", 0)):
        key = f"{LOST_KEY}/{round_}/{i}"
        try:  # a record counted and not written yet (or never) is not waited for here: a get would wait
            if store.check([key]):
                out.add(tuple(json.loads(store.get(key))))
        except (ValueError, TypeError, dist.DistError):
            continue  # damaged: that node is waited for (torch's last call)
    return out


def members(handler) -> dict[tuple, int]:
    """The participants of the round ``handler`` (torch's) last joined: node identity → its rank."""
    holder = getattr(handler, "_state_holder", None)
    participants = getattr(getattr(holder, "state", None), "participants", None) or {}
    return {dataclasses.astuple(n): r for n, r in participants.items() if dataclasses.is_dataclass(n)}


class CloseWhenBack:
    """While ``handler`` (torch's) forms its next round: a thread that closes the round once every
    node of the last round (``last``) but the ones lost (``lost()``) joined it, and no other
    node the rendezvous knows is still to join. ``stop()`` when the handler returned."""

    def __init__(self, handler, last: frozenset[tuple], lost):
        self._holder = _own_holder(handler)
        self._last, self._lost = last, lost
        self._stopped = threading.Event()
        self.closed_early = False
        self._thread = threading.Thread(target=self._run, name="rendezvous-close", daemon=True)
        if self._holder is not None and last:
            self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        try:
            while not self._stopped.wait(POLL_S) and not self.closed_early:
                self.closed_early = self._close_if_all_back()
        except (RendezvousError, RuntimeError, OSError, ValueError) as err:
            print(
                f"rendezvous: the round waits for its last call ({type(err).__name__}: {err})",
                file=sys.stderr,
                flush=True,
            )

    def _close_if_all_back(self) -> bool:
        self._holder.sync()
        state = self._holder.state
        if state.closed or state.complete or state.deadline is None:
            return False  # the last round not left by all yet, or the new one below min_nodes
        joined = {dataclasses.astuple(n) for n in state.participants}
        known = {dataclasses.astuple(n) for n in state.last_heartbeats}
        if not known <= joined or not (self._last - self._lost()) <= joined:
            return False
        now = datetime.now(timezone.utc)
        if state.deadline <= now:
            return True  # due anyway
        state.deadline = now
        self._holder.mark_dirty()
        if not self._holder.sync():
            return False  # another node changed the state meanwhile: look again
        print(
            f"rendezvous: every node of the last round but {len(self._last & self._lost())} lost is back: the round "
            "closes without its last call",
            file=sys.stderr,
            flush=True,
        )
        return True


def _own_holder(handler):
    """A state holder of the rendezvous's state beside ``handler``'s (whose one its own thread
    uses while the round forms), reading the backend on every look; None on a torch without one."""
    holder = getattr(handler, "_state_holder", None)
    backend, settings = getattr(holder, "_backend", None), getattr(holder, "_settings", None)
    if backend is None or settings is None:
        return None
    try:
        return type(holder)(backend, settings, cache_duration=0)
    except TypeError:
        return None
