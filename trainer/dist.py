"""Process-group set-up and tear-down for workers started by a node agent (``trainer.agent.single_node``
for one node, torch's elastic agent for several).

Two torch 2.13 + gloo traps are handled here (see docs/platform.md):
- restarted workers must not meet dead peers in the shared rendezvous store, so the group is
  built on a per-restart prefix of the agent's store;
- gloo can abort at interpreter exit, so workers leave with ``os._exit`` after tearing down.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    restart_count: int
    device: torch.device
    backend: str
    epoch: int = 0  # fast recoveries (new groups of the same processes) in this round; 0: as started


def local_world_size() -> int:
    """Workers on this node (set by the elastic agent or the node agent; 1 when run alone)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


@dataclass(frozen=True)
class Identity:
    """Who a worker is: set by the node agent in its environment, or, for a warm spare, handed
    over through the agent's store when it takes a lost rank's place."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    restart_count: int = 0  # full restarts of the job's workers (torch elastic's name for it)
    epoch: int = 0  # fast recoveries in this round (trainer.resilience.peers)

    @classmethod
    def from_env(cls, env=os.environ) -> Identity:
        return cls(
            int(env.get("RANK", "0")),
            int(env.get("LOCAL_RANK", "0")),
            int(env.get("WORLD_SIZE", "1")),
            int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            int(env.get(EPOCH_ENV, "0")),
        )


EPOCH_ENV = "PRETRAIN_EPOCH"  # set by the single-node agent for a replacement: the epoch it joins
FAST_RECOVERY_ENV = "PRETRAIN_FAST_RECOVERY"  # seconds a fast recovery may take (> 0: survivors of a lost peer rejoin)


def pick_backend(requested: str) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def group_prefix(restart: int, epoch: int) -> str:
    """The store prefix of a round's process group: restarted workers never meet dead peers'
    keys, nor do the processes of a fast recovery (a new epoch) meet the broken group's."""
    return f"attempt_{restart}" if epoch == 0 else f"attempt_{restart}_epoch_{epoch}"


def own_round_store(env=os.environ) -> bool:
    """Whether torch's elastic agent keeps its store to itself (``TORCHELASTIC_USE_AGENT_STORE=False``
    in a worker's environment ``env``: a job with standby nodes): rank 0 then hosts a fresh store
    for the round at MASTER_PORT, and the store goes with it."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "False"


def listening(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether ``host:port`` accepts a connection now."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def wait_listening(host: str, port: int, timeout_s: float, poll_s: float = 0.01) -> None:
    """Until ``host:port`` accepts a connection (at most ``timeout_s``): a TCPStore client refused
    by a server not yet listening backs off for up to a second before it tries again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not listening(host, port, timeout_s):
        time.sleep(poll_s)  # the round's rank 0 is starting its store


def connect_store(timeout_s: float, rank: int = 0) -> dist.TCPStore:
    """The job's store at MASTER_ADDR/MASTER_PORT: the node agent's (a client of it), or the round's
    own, hosted by rank 0 (``own_round_store``), as ``env://`` would."""
    host, port, own = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), own_round_store()
    if own and rank != 0:
        wait_listening(host, port, timeout_s)
    return dist.TCPStore(host, port, is_master=own and rank == 0, timeout=timedelta(seconds=timeout_s))


def agreed_restart_count(store: dist.Store, me: Identity) -> Identity:
    """Torch counts restarts per agent, so a standby node's workers joining in a later round say 0
    where the others say 1 or more; the round's group prefix and the checks after a restart need
    one number: the largest, agreed through the round's (fresh) store."""
    store.set(_restart_count_key(me.rank), str(me.restart_count))
    store.wait([_restart_count_key(r) for r in range(me.world_size)])
    return replace(me, restart_count=round_restart_count(store, me.world_size, me.restart_count))


def _restart_count_key(rank: int) -> str:
    return f"restart_count/{rank}"


def round_restart_count(store: dist.Store, world_size: int, own: int) -> int:
    """The restart count the round's ranks agreed on (``agreed_restart_count``); ``own`` (this
    node's count) where the ranks did not publish theirs: the agents share one store and count alike."""
    keys = [_restart_count_key(r) for r in range(world_size)]
    if not store.check(keys):
        return own
    return max(int(store.get(key)) for key in keys)


def join_group(base: dist.Store, backend: str, me: Identity, timeout_s: float) -> None:
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(group_prefix(me.restart_count, me.epoch), base),
        rank=me.rank,
        world_size=me.world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def init_distributed(
    backend: str = "auto", timeout_s: float = 300, me: Identity | None = None, base: dist.Store | None = None
) -> DistInfo:
    """Join the job's process group as ``me`` (default: from the environment) through the agent's
    store ``base`` (default: connect to it)."""
    me = me or Identity.from_env()
    backend = pick_backend(backend)
    if backend == "nccl":
        torch.cuda.set_device(me.local_rank)
        device = torch.device("cuda", me.local_rank)
    else:
        device = torch.device("cpu")
    if me.world_size > 1 or "MASTER_ADDR" in os.environ:
        base = base or connect_store(timeout_s, me.rank)
        if own_round_store():
            me = agreed_restart_count(base, me)
        join_group(base, backend, me, timeout_s)
    return DistInfo(me.rank, me.local_rank, me.world_size, me.restart_count, device, backend, me.epoch)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_gather_object(obj: object) -> list:
    if not is_initialized():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: object, src: int = 0) -> object:
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    if is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t


def shutdown_and_exit(code: int) -> None:
    """Tear down the process group and leave without running atexit handlers (gloo trap)."""
    try:
        if is_initialized():
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
