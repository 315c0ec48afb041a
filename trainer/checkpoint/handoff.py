"""A replacement takes a survivor's live model and optimizer straight into its own tensors.

Under DDP (without dropout) every rank holds the same model and optimizer state, so a rank that
replaces a lost one takes them from a survivor over the new process group. The survivor sends
each tensor as it lies in memory and the replacement receives each into the tensor it trains
with: no packing into one buffer on either side, no second copy into the model, no pickling
(on the recovery bench's larger model, ``--d-model 384 --layers 6``, ~130 MB: packing, the
broadcast of the packed buffer and the load took 140–230 ms of the recovery; a fresh 130 MB
buffer alone costs ~55 ms of page faults on each side).

Both sides list their tensors in the same order: the model's (parameters and persistent
buffers, a tied weight once), then each parameter's optimizer state by key. What the source
holds (``signature``: names, shapes, dtypes; the optimizer's non-tensor state and
hyperparameters) travels with the step it completed, gathered from every rank before; a
replacement whose optimizer has no state yet (a fresh one builds it lazily at its first step)
creates the tensors to receive into. A model that does not match
(another architecture) raises ``HandoffMismatch``: the recovery falls back to a full restart.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class HandoffMismatch(RuntimeError):
    """The replacement's model is not the survivor's (names or shapes differ)."""


def _params(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def model_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters and persistent buffers in ``state_dict`` order, a tied weight once."""
    seen, out = set(), []
    for name, t in model.state_dict(keep_vars=True).items():
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def _wired(t: torch.Tensor, backend: str) -> bool:
    """Does ``t`` travel as a message of the group's backend (NCCL: device memory; gloo: host
    memory)? Any other tensor (under NCCL the optimizer's step counters on the CPU) travels
    pickled with the signature."""
    return t.device.type == ("cuda" if backend == "nccl" else "cpu")


def live_tensors(model, optimizer, backend: str) -> list[torch.Tensor]:
    """Every tensor a replacement takes as a message, in the order both sides hold them."""
    out = [t.detach() for _, t in model_tensors(model)]
    for p in _params(optimizer):
        st = optimizer.state.get(p, {})
        out += [v.detach() for v in st.values() if isinstance(v, torch.Tensor) and _wired(v, backend)]
    return out


def _described(t: torch.Tensor) -> tuple[list[int], str]:
    return list(t.shape), str(t.dtype).removeprefix("torch.")


def _state_entry(value, param: torch.Tensor, backend: str) -> dict:
    if isinstance(value, torch.Tensor) and _wired(value, backend):
        return {"tensor": _described(value), "on_param_device": value.device == param.device}
    return {"value": value.clone() if isinstance(value, torch.Tensor) else value}


def signature(model, optimizer, backend: str) -> dict:
    """What the source holds: its model's tensors, each parameter's optimizer state (tensors
    described, other values as they are) and the hyperparameters of each parameter group."""
    state = [
        {k: _state_entry(v, p, backend) for k, v in optimizer.state.get(p, {}).items()} for p in _params(optimizer)
    ]
    return {
        "model": [(name, *_described(t)) for name, t in model_tensors(model)],
        "optimizer": state,
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
    }


def adopt(sig: dict, model, optimizer) -> None:
    """Make a replacement's model and optimizer ready to receive the source's tensors: check the
    model matches, create the optimizer state it lacks, take the values that travelled with the
    signature."""
    mine = [(name, *_described(t)) for name, t in model_tensors(model)]
    theirs = [tuple(entry) for entry in sig["model"]]
    params = _params(optimizer)
    if mine != theirs or len(params) != len(sig["optimizer"]) or len(optimizer.param_groups) != len(sig["groups"]):
        diff = next(((a, b) for a, b in zip(mine, theirs) if a != b), (len(mine), len(theirs)))
        raise HandoffMismatch(f"the replacement's model differs from the survivor's (first difference: {diff})")
    for p, entries in zip(params, sig["optimizer"]):
        held, st = optimizer.state.get(p, {}), {}  # in the source's order: both sides list their tensors alike
        for key, entry in entries.items():
            if "value" in entry:
                st[key] = entry["value"]
                continue
            shape, dtype = entry["tensor"]
            device = p.device if entry["on_param_device"] else torch.device("cpu")
            have = held.get(key)
            fits = isinstance(have, torch.Tensor) and _described(have) == (shape, dtype) and have.device == device
            st[key] = have if fits else torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        optimizer.state[p] = st  # state the source does not hold is dropped
    for group, hyper in zip(optimizer.param_groups, sig["groups"]):
        group.update(hyper)


BUCKET_MIN_BYTES = 1 << 20  # smaller tensors travel packed, one buffer per dtype (each message costs ~0.1 ms)


def pack(group: list[torch.Tensor]) -> torch.Tensor:
    """Tensors of one dtype and device as one flat message."""
    return torch.cat([t.reshape(-1) for t in group])


def unpack(flat: torch.Tensor, group: list[torch.Tensor]) -> None:
    """A packed message into the tensors it was packed from (``group`` in the same order)."""
    pieces = flat.split([t.numel() for t in group])
    torch._foreach_copy_(group, [piece.view_as(t) for piece, t in zip(pieces, group)])  # one call, not one per tensor


def messages(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """The tensors sent as they are (large ones) and the groups of small ones packed together."""
    large, small = [], {}
    for t in tensors:
        if t.numel() * t.element_size() >= BUCKET_MIN_BYTES:
            large.append(t)
        else:
            small.setdefault((t.dtype, t.device), []).append(t)
    return large, list(small.values())


def hand_over(rank: int, src: int, receivers: list[int], model, optimizer, backend: str, sig: dict) -> None:
    """Every rank of the group calls it: ``src`` sends its live state to each rank of
    ``receivers``, which takes it into its own model and optimizer (``sig``: the source's
    ``signature``, which every rank learnt with the step the survivors hold); the others return."""
    if rank in receivers:
        adopt(sig, model, optimizer)
    elif rank != src:
        return
    large, groups = messages(live_tensors(model, optimizer, backend))
    packed = [
        pack(group)
        if rank == src
        else torch.empty(sum(t.numel() for t in group), dtype=group[0].dtype, device=group[0].device)
        for group in groups
    ]
    if 1 + len(receivers) == dist.get_world_size():  # no bystander: a broadcast (gloo's first send to a peer
        works = [dist.broadcast(t, src, async_op=True) for t in large + packed]  # in a new group waits ~20 ms)
    elif rank == src:
        works = [dist.isend(t, dst) for dst in receivers for t in large + packed]
    else:
        works = [dist.irecv(t, src) for t in large + packed]
    for work in works:
        work.wait()
    if rank != src:
        for flat, group in zip(packed, groups):
            unpack(flat, group)
