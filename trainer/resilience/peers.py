"""Fast recovery, worker side: a lost peer is replaced while the other workers keep running.

Under the single-node agent (``trainer.agent.single_node``) a worker that dies does not take the
others with it. A survivor finds out from the collective that fails (gloo: a SIGKILLed peer's
connection closes, the collective raises within milliseconds); the agent, which saw the death,
announces a new **epoch** in its store (``epoch_key``: the lost ranks, how they are replaced:
``spare`` or ``replacement`` (cold start), and when the agent noticed). The survivor destroys
the broken process group, joins a new one under a new store prefix (``dist.group_prefix``) with
the same ranks, restores the newest state every rank agrees on into its live model and
optimizer (``state.restore``, as the in-process NaN rollback does: bitwise exact), re-wraps DDP
and goes on. The replacement (a warm spare, or a cold-started worker) starts as any worker does
and meets the survivors in the new group. Every rank reports itself ready (``ready_key``); the
agent falls back to a full restart if they are not all ready within its bound.

A warm spare is a worker process started ahead with torch imported and the model built, blocked
on its key in the store (``spare_key``) until the agent hands it a rank (``wait_for_rank``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace
from datetime import timedelta

import torch.distributed as dist

from trainer.checkpoint import state
from trainer.checkpoint.state import Restored
from trainer.dist import FAST_RECOVERY_ENV, DistInfo, Identity, join_group, round_restart_count
from trainer.job.config import JobConfig
from trainer.job.events import IN_PROCESS_SOURCES, EventKind
from trainer.resilience.nodecheck import NODE_ENV
from trainer.resilience.survivor_interrupt import PeerLost

NOTICE_S = 10.0  # after a failed collective, how long a survivor waits for the agent to announce a lost peer
NOTICE_ENV = "PRETRAIN_PEER_NOTICE_S"  # set by an agent of several nodes: a lost node announces nothing
# A worker's exit code when it left because a peer was lost and no recovery was announced (a
# lost node, a recovery not attempted): its agent restarts every worker instead of replacing it
# (it is not the cause; replacing it would wait for peers that are gone)
PEER_LOST_EXIT = 75
NODE_LOST_PATH = "node_lost"  # an epoch's path when an agent found another node gone: no recovery, survivors leave


def notice_for_nodes(node_timeout_s: float) -> float:
    """How long survivors on several nodes wait for an announcement: the lost worker's node
    agent makes it within a monitor interval (0.2 s), a lost node never does. Half the node
    timeout (at least 1 s): the rendezvous waits for the lost node's keep-alives to lapse anyway,
    and most of the wait is spent meanwhile."""
    return max(1.0, node_timeout_s / 2)


def epoch_key(restart: int, epoch: int) -> str:
    """The agent's record of a fast recovery: {"lost": [ranks], "path", "detected_at"}."""
    return f"fastrec/attempt_{restart}/epoch_{epoch}"


def ready_key(restart: int, epoch: int, rank: int) -> str:
    """Set by ``rank`` once it restored its state in the epoch's new group."""
    return epoch_key(restart, epoch) + f"/ready/rank_{rank}"


def spare_key(spare: int) -> str:
    """Where warm spare ``spare`` learns the identity it takes over."""
    return f"fastrec/spare_{spare}"


def drill_key(restart: int, drill: int) -> str:
    """Set by the first rank that saw a warm spare before chaos drill ``drill`` (its index in the spec)."""
    return f"fastrec/attempt_{restart}/drill_{drill}/spare_seen"


def warm_key(node: int) -> str:
    """Counter: the node's warm spares that got warm (reset by its agent when a round starts new ones)."""
    return f"fastrec/node_{node}/spares_warm"


def taken_key(node: int) -> str:
    """Counter: the node's warm spares its agent handed a rank."""
    return f"fastrec/node_{node}/spares_taken"


WARM_SPARES_ENV = "PRETRAIN_WARM_SPARES"  # warm spares the worker's agent keeps per node (0: a lost rank starts cold)


def epochs_key(restart: int) -> str:
    """The counter of the epochs announced in round ``restart``."""
    return f"fastrec/attempt_{restart}/epochs"


def announce(store: dist.Store, restart: int, lost: list[int], path: str, detected_at: float) -> int:
    """An agent's announcement of a fast recovery: the next epoch of round ``restart`` (taken from a
    counter in the store, so that agents of several nodes never announce the same epoch), the
    global ranks ``lost`` and how they are replaced (``spare``, ``replacement``; ``NODE_LOST_PATH``:
    not at all, another node is gone and the survivors leave for a new round). The survivors,
    on every node, wait for it (``Peers.announced``); returns the epoch."""
    epoch = store.add(epochs_key(restart), 1)
    store.set(epoch_key(restart, epoch), json.dumps({"lost": lost, "path": path, "detected_at": detected_at}))
    return epoch


def all_ready(store: dist.Store, restart: int, epoch: int, world_size: int) -> bool:
    """Whether every rank restored its state in the epoch's new group (one look at the store)."""
    return store.check([ready_key(restart, epoch, r) for r in range(world_size)])


def not_ready(store: dist.Store, restart: int, epoch: int, world_size: int) -> list[int]:
    """The ranks not yet restored in the epoch's new group (what a fallback's message names)."""
    return [r for r in range(world_size) if not store.check([ready_key(restart, epoch, r)])]


def spares_available(store: dist.Store, node: int) -> int:
    return store.add(warm_key(node), 0) - store.add(taken_key(node), 0)


def hand_rank(store: dist.Store, spare: int, node: int, me: Identity) -> None:
    """An agent hands identity ``me`` to warm spare ``spare`` of ``node`` (``wait_for_rank``)."""
    store.add(taken_key(node), 1)
    store.set(spare_key(spare), json.dumps(asdict(me)))


def wait_for_rank(store: dist.Store, spare: int, node: int) -> Identity:
    """Block (a warm spare of ``node``) until its agent hands this process a lost rank."""
    key = spare_key(spare)
    store.add(warm_key(node), 1)
    while True:
        try:
            store.wait([key], timedelta(hours=1))
            return Identity(**json.loads(store.get(key)))
        except (
            dist.DistStoreError
        ):  # an hour without a fault: keep waiting (the orphan watchdog ends us with the agent)
            continue


def fast_recovery_bound_s(env=os.environ) -> float:
    """How long a fast recovery may take, as the worker's agent set it (0: survivors are not kept)."""
    try:
        return float(env.get(FAST_RECOVERY_ENV) or 0)
    except ValueError:
        return 0.0


def arrive(store: dist.Store, me: Identity, bound_s: float) -> None:
    """Before joining epoch ``me.epoch``'s group: until every rank of the world arrived (at most
    ``bound_s``), so that a recovery that lost a second worker (or the replacement's node) ends in
    the fallback within the agent's bound, not after the process group's timeout in its set-up."""
    key = lambda rank: epoch_key(me.restart_count, me.epoch) + f"/arrived/rank_{rank}"  # noqa: E731
    store.set(key(me.rank), "1")
    try:
        store.wait([key(r) for r in range(me.world_size)], timedelta(seconds=bound_s))
    except dist.DistError as err:
        try:  # a rank that comes later must not take this one, which leaves now, for arrived
            store.delete_key(key(me.rank))
        except (dist.DistError, RuntimeError):
            pass  # the store is gone too: nobody can arrive
        raise CannotRejoin(f"not every rank arrived for the fast recovery within {bound_s:g} s: {err}") from None


def arrive_as_replacement(store: dist.Store, me: Identity, bound_s: float) -> Identity:
    """A replacement's ``arrive``, under the restart count the round's ranks agreed on (a standby
    node's agent counts fewer restarts than the others: ``dist.agreed_restart_count``)."""
    me = replace(me, restart_count=round_restart_count(store, me.world_size, me.restart_count))
    arrive(store, me, bound_s)
    return me


def exit_code(err: BaseException, fast: bool) -> int:
    """A failed worker's exit code: ``PEER_LOST_EXIT`` when it kept its survivors' part (``fast``)
    and left because its collective broke with no recovery announced, else 1."""
    return PEER_LOST_EXIT if fast and may_be_peer_loss(err) else 1


def may_be_peer_loss(err: BaseException) -> bool:
    """Could ``err`` be a collective broken by a lost peer? (gloo raises a plain RuntimeError
    naming its transport; NCCL/store errors are DistErrors; ``PeerLost``: the agent interrupted the
    step.) Anything else is the worker's own."""
    return isinstance(err, (dist.DistError, PeerLost)) or (isinstance(err, RuntimeError) and "gloo" in str(err).lower())


@dataclass
class Peers:
    """A worker's link to the agent's store for fast recoveries."""

    store: dist.Store  # the job's store (the agent's or the round's; not a prefix of it)
    me: Identity
    backend: str
    timeout_s: float  # the process group's timeout
    warm_spares: int = 0  # warm spares the agent keeps (a drill waits for one before it takes a worker away)
    notice_s: float = NOTICE_S  # how long a survivor waits for the announcement of a lost peer
    bound_s: float = 30.0  # how long the agent gives a fast recovery (fault_tolerance.fast_recovery_timeout_s)
    node: int = 0  # the node this worker runs on (its agent's spares)

    @classmethod
    def from_env(cls, store: dist.Store, me: Identity, backend: str, timeout_s: float, env=os.environ) -> Peers:
        return cls(
            store,
            me,
            backend,
            timeout_s,
            int(env.get(WARM_SPARES_ENV) or 0),
            float(env.get(NOTICE_ENV) or NOTICE_S),
            fast_recovery_bound_s(env),
            int(env.get(NODE_ENV) or 0),
        )

    def announced(self, err: BaseException) -> dict | None:
        """After ``err`` in a collective: the agent's record of the next epoch, if it announces
        one within ``notice_s`` (None: no peer was lost, or the whole node it ran on, or the error
        is this worker's own, or an agent found the lost peer's whole node gone)."""
        if not may_be_peer_loss(err):
            return None
        key = self._next_epoch_key()
        try:
            self.store.wait([key], timedelta(seconds=self.notice_s))
            record = json.loads(self.store.get(key))
        except dist.DistError:
            return None
        return None if record.get("path") == NODE_LOST_PATH else record

    def _next_epoch_key(self) -> str:
        return epoch_key(self.me.restart_count, self.me.epoch + 1)

    def next_epoch_announced(self) -> bool:
        """Whether the agent announced the next recovery (one look at the store; False while it is away)."""
        try:
            return self.store.check([self._next_epoch_key()])
        except (dist.DistError, RuntimeError):
            return False

    def wait_for_spare(self, beat, drill: int, victim: bool, timeout_s: float = 120.0) -> bool:
        """Before drill ``drill`` takes a worker away: until the victim's node has a warm spare (a
        drill rehearses the recovery the spec configures, not the start-up race of the first
        spare); ``beat()`` keeps this worker's heartbeat fresh meanwhile. The ``victim`` (the rank
        the drill takes) looks at its node's spares and lets every rank go on (``drill_key``);
        the others wait for that: they do not know the victim's node, and its loss takes the spare
        at once, so a rank looking for one afterwards would wait for a spare that comes only after
        the recovery, while the agent waits for it to rejoin. True: the victim saw a spare or
        gave up (after ``timeout_s``: the drill goes on, its replacement starts cold); False: this
        rank gave up waiting for the victim."""
        go = drill_key(self.me.restart_count, drill)
        deadline = time.monotonic() + timeout_s
        next_beat = 0.0
        while not self.store.check([go]):
            if victim and (spares_available(self.store, self.node) >= 1 or time.monotonic() >= deadline):
                self.store.set(go, "1")
                break
            if time.monotonic() >= deadline:
                return False
            if time.monotonic() >= next_beat:
                beat()
                next_beat = time.monotonic() + 0.5
            time.sleep(0.02)  # polls the store's counters
        return True

    def rejoin(self) -> Identity:
        """Leave the broken group; join the next epoch's, same rank, same world."""
        dist.destroy_process_group()
        self.me = replace(self.me, epoch=self.me.epoch + 1)
        arrive(self.store, self.me, self.bound_s)
        join_group(self.store, self.backend, self.me, self.timeout_s)
        return self.me

    def ready(self, restored, write_event) -> None:
        """This rank restored its state in the new group; rank 0 records the recovery (how,
        and how long since the agent noticed the loss). Nothing to do in epoch 0."""
        if self.me.epoch == 0:
            return
        record = json.loads(self.store.get(epoch_key(self.me.restart_count, self.me.epoch)))
        if self.me.rank == 0:
            write_event(
                {
                    "event": EventKind.ROLLBACK,
                    "rank": 0,
                    "path": record["path"],
                    "lost_ranks": record["lost"],
                    "epoch": self.me.epoch,
                    "step": restored.step,
                    "source": restored.source,
                    "checkpoint": restored.checkpoint,
                    "seconds": round(time.time() - record["detected_at"], 4),
                }
            )
        self.store.set(ready_key(self.me.restart_count, self.me.epoch, self.me.rank), "1")


class CannotRejoin(RuntimeError):
    """The survivors have nothing to roll back to in place: the node agent restarts every worker."""


def rejoin(
    cfg: JobConfig, info: DistInfo, peers: Peers, live: tuple[int, int], *, model, optimizer, snapshots
) -> tuple[DistInfo, Restored]:
    """A survivor's part of a fast recovery: the next epoch's group, then the state it holds
    (``live``: its completed step and data position) if every survivor holds the same step
    (``state.kept_by_survivors``), else the newest state every rank agrees on restored into its
    live model and optimizer (what a restarted worker would load)."""
    info = replace(info, epoch=peers.rejoin().epoch)
    optimizer.zero_grad(set_to_none=True)  # the broken step's gradients
    restored = state.kept_by_survivors(cfg, info, live, model=model, optimizer=optimizer) or state.restore(
        cfg, info, model=model, optimizer=optimizer, snapshots=snapshots
    )
    if restored.source not in IN_PROCESS_SOURCES:
        raise CannotRejoin(
            f"a peer was lost before this stage's first snapshot or checkpoint ({restored.source}): "
            "only fresh processes can start the model over"
        )
    return info, restored
