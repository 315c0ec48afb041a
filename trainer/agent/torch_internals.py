"""Where this project reaches into torch's private elastic internals, in one place.

Torch's c10d rendezvous and its elastic agent have no public hooks for what a node agent here needs;
these functions patch private names of ``torch.distributed.elastic.rendezvous.dynamic_rendezvous`` in
the agent's own process, each a no-op on a torch that lacks what it patches. ``SurvivorsAgent``
(``trainer.agent.survivors``) subclasses ``LocalElasticAgent`` and overrides its private
``_start_workers``, ``_rendezvous``, ``_exit_barrier``, ``_shutdown`` and ``_monitor_workers``.

Verified against torch ``VERIFIED_WITH``. On a torch upgrade, re-verify (the tests that check each
against the installed torch are named):
- ``_delay`` and ``_BackendRendezvousStateHolder.__init__(backend, settings, cache_duration)``:
  :func:`fast_rendezvous_polls` (tests/scenarios/test_elastic.py);
- ``_RendezvousJoinOp.__call__(ctx, deadline)``, ``_Action.REMOVE_FROM_WAIT_LIST`` and the state's
  ``closed``, ``complete``, ``wait_list``, ``participants``: :func:`stand_by_when_round_full`
  (tests/scenarios/test_elastic.py);
- ``_BackendRendezvousStateHolder._sanitize``, ``_state``, ``_dead_nodes``, ``_backend._store``:
  :func:`record_expired_nodes` (tests/scenarios/test_node_links.py);
- ``LocalElasticAgent``'s private methods above: the survivors' tests (tests/scenarios/test_elastic.py,
  test_fast_recovery.py).
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist

from trainer.agent.rendezvous_close import EXPIRED, lost_from, record_lost

RENDEZVOUS_POLL_S = 0.1  # torch's rendezvous polls its store once a second while a round forms
VERIFIED_WITH = "2.13"  # torch major.minor these patches were checked against


def unverified_torch(version: str | None = None) -> str | None:
    """What to say when the installed torch is not the one these patches were verified with."""
    version = version or torch.__version__
    if ".".join(version.split("+")[0].split(".")[:2]) == VERIFIED_WITH:
        return None
    return (
        f"torch {version}: the elastic agent's patches of torch internals were verified with torch "
        f"{VERIFIED_WITH} (trainer/agent/torch_internals.py says what to re-verify)"
    )


def fast_rendezvous_polls(poll_s: float = RENDEZVOUS_POLL_S) -> None:
    """Make torch's rendezvous look at its store every ``poll_s`` instead of every second while a
    round forms (or while a standby waits): it sleeps 1 s between polls and serves a cached state
    for 1 s, so each of the three or so looks between a lost node's keep-alives lapsing and the
    new round cost up to a second. In this process only (a node agent), before its rendezvous
    handler is made; the rendezvous' other delays (its random start-up jitter) are kept. A torch
    without these internals keeps its own pace (``tests/scenarios/test_elastic.py`` checks this one's)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv

    slow = getattr(rdzv, "_delay", None)
    if slow is None or getattr(slow, "poll_s", None) is not None or not hasattr(rdzv, "_BackendRendezvousStateHolder"):
        return

    def delay(seconds):
        slow(poll_s if seconds == 1 else seconds)

    delay.poll_s = poll_s
    rdzv._delay = delay
    holder = rdzv._BackendRendezvousStateHolder
    init = holder.__init__

    def fresher(self, backend, settings, cache_duration=poll_s):
        init(self, backend, settings, cache_duration)

    holder.__init__ = fresher


def stand_by_when_round_full() -> None:
    """Make a node that waits for a round which filled up without it stand by quietly, as a
    standby does. Torch's rendezvous puts a node joining while a participant of the last round
    restarts on its wait list; if the others fill the next round (``max_nodes``) first, it stays
    on that list, and every participant's agent, seeing a node waiting, restarts its workers to
    take it in, forming the same full round again: a loop, seen after a full restart with a
    standby node (three nodes racing for two places on 2 busy cores: six rounds in 4 s, until the
    waiting node happened to win a place). Such a node now leaves the wait list, and torch's next
    look puts it on its redundancy list. In this process only (a node agent); a torch without
    this join operation keeps its own (``tests/scenarios/test_elastic.py`` checks this one's)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv

    op, action = getattr(rdzv, "_RendezvousJoinOp", None), getattr(rdzv, "_Action", None)
    if op is None or action is None or getattr(op.__call__, "stands_by", False):
        return
    join = op.__call__

    def call(self, ctx, deadline):
        state = ctx.state
        if (
            not state.closed
            and state.complete
            and ctx.node in state.wait_list
            and ctx.node not in state.participants
            and len(state.participants) >= ctx.settings.max_nodes
        ):
            return action.REMOVE_FROM_WAIT_LIST  # the next look: ADD_TO_REDUNDANCY_LIST
        return join(self, ctx, deadline)

    call.stands_by = True
    op.__call__ = call


def record_expired_nodes(on_expired=None) -> None:
    """Make torch's rendezvous, in this process (a node agent), record every node its look at the
    state finds dead (its keep-alives lapsed) in the rendezvous's store (``EXPIRED``) as it drops
    it. ``on_expired(desc)`` is called for each such node that was a participant of the round and
    was not found lost through its links already (``record_lost`` for that round): a node that
    went silent, found only now. Through torch's private state holder (its ``_sanitize`` and the
    dead nodes it lists; checked against this torch by ``tests/scenarios/test_node_links.py``); a torch
    without them records nothing, and such a node keeps its last call. Installed once per process
    (one node agent), with the first caller's ``on_expired``."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv

    holder = getattr(rdzv, "_BackendRendezvousStateHolder", None)
    sanitize = getattr(holder, "_sanitize", None)
    if sanitize is None or getattr(sanitize, "records_expired", False):
        return

    def _sanitize(self) -> None:
        state = getattr(self, "_state", None)
        was_in = {
            dataclasses.astuple(n) for n in getattr(state, "participants", None) or () if dataclasses.is_dataclass(n)
        }
        sanitize(self)
        dead = {dataclasses.astuple(n) for n in getattr(self, "_dead_nodes", None) or () if dataclasses.is_dataclass(n)}
        recorded = self.__dict__.setdefault("_pretrain_recorded", set())
        store = getattr(getattr(self, "_backend", None), "_store", None)
        for desc in sorted(dead - recorded) if store is not None else ():
            try:
                silent = desc in was_in and desc not in lost_from(store, getattr(state, "round", -1))
                record_lost(store, EXPIRED, desc)
                recorded.add(desc)
            except (dist.DistError, RuntimeError):
                return  # the store is away for a moment: the next look records it
            if silent and on_expired is not None:
                try:
                    on_expired(desc)
                except OSError as err:  # the job's event stream cannot be written: the rendezvous goes on
                    print(f"rendezvous: node {desc} dropped, not recorded ({err})", file=sys.stderr, flush=True)

    _sanitize.records_expired = True
    holder._sanitize = _sanitize
