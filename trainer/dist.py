"""Process-group set-up and tear-down for workers started by torch's elastic agent.

Two torch 2.13 + gloo traps are handled here (see docs/platform.md):
- restarted workers must not meet dead peers in the shared rendezvous store, so the group is
  built on a per-restart prefix of the agent's store;
- gloo can abort at interpreter exit, so workers leave with ``os._exit`` after tearing down.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
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


def pick_backend(requested: str) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str = "auto", timeout_s: float = 300) -> DistInfo:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    backend = pick_backend(backend)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world > 1 or "MASTER_ADDR" in os.environ:
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                             is_master=False, timeout=timedelta(seconds=timeout_s))
        store = dist.PrefixStore(f"attempt_{restart}", base)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    return DistInfo(rank, local_rank, world, restart, device, backend)


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
