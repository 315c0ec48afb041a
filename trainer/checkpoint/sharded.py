"""Sharded (FSDP2) training state: each rank keeps only its piece of every sharded tensor.

In a checkpoint or snapshot a DTensor becomes a *piece*: a plain dict ``{"__piece__": local
tensor, "shape": global shape, "dim": sharded dim (None: replicated), "offset": start row}``,
so it passes ``torch.load(weights_only=True)`` and the pickle-free shared-memory layout.
Pieces carry what is needed to reassemble the full tensor from the pieces of all ranks
(:func:`consolidate`) or to cut a rank's piece out of a full tensor (:func:`apply_sharded`).

Layouts FSDP2 produces here (``fully_shard`` on a 1-D mesh): ``Shard(0)`` with ``torch.chunk``
semantics (ranks ``0..k`` hold ceil(n / world) rows, the rest fewer or none) and ``Replicate``.
Anything else is rejected with an error naming the tensor and its placements.
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.checkpoint import store as ckpt

PIECE = "__piece__"


class ShardLayoutError(ValueError):
    """Rank pieces do not fit together (missing, overlapping or of another world size)."""


def is_piece(obj) -> bool:
    return isinstance(obj, dict) and PIECE in obj


def chunk_bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """(offset, length) of ``rank``'s chunk when ``n`` rows are split as ``torch.chunk`` does."""
    size = -(-n // world) if n else 0
    start = min(n, rank * size)
    return start, max(0, min(n, start + size) - start)


def _dtensor_type():
    from torch.distributed.tensor import DTensor

    return DTensor


def _shard_dim(t, where: str) -> int | None:
    """The sharded dim of a DTensor on a 1-D mesh, or None when it is replicated."""
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(t.placements)
    if t.device_mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0], (Shard, Replicate)):
        raise ShardLayoutError(
            f"{where}: placements {placements} on a {t.device_mesh.ndim}-D mesh are not supported "
            "(only fully_shard's Shard(dim) or Replicate on a 1-D mesh)"
        )
    return placements[0].dim if isinstance(placements[0], Shard) else None


def _piece_of(t, where: str) -> dict:
    dim = _shard_dim(t, where)
    local = t.to_local()
    offset = 0
    if dim is not None:
        mesh = t.device_mesh
        offset, length = chunk_bounds(t.shape[dim], mesh.size(), mesh.get_local_rank())
        if local.shape[dim] != length:
            raise ShardLayoutError(
                f"{where}: local shard has {local.shape[dim]} rows along dim {dim}, expected {length} "
                f"(torch.chunk of {t.shape[dim]} over {mesh.size()} ranks)"
            )
    return {PIECE: local, "shape": list(t.shape), "dim": dim, "offset": offset}


def localize(obj, where: str = "state"):
    """``obj`` with every DTensor replaced by this rank's piece (no copy, no communication)."""
    if isinstance(obj, _dtensor_type()):
        return _piece_of(obj, where)
    if isinstance(obj, dict):
        return {k: localize(v, f"{where}.{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(localize(v, f"{where}[{i}]") for i, v in enumerate(obj))
    return obj


def _join(pieces: list[dict], where: str) -> torch.Tensor:
    head = pieces[0]
    if any(p["shape"] != head["shape"] or p["dim"] != head["dim"] for p in pieces):
        raise ShardLayoutError(
            f"{where}: ranks disagree on the global shape or sharded dim "
            f"({sorted({(tuple(p['shape']), p['dim']) for p in pieces})})"
        )
    if head["dim"] is None:
        return head[PIECE]
    dim, expected = head["dim"], 0
    ordered = sorted(pieces, key=lambda p: p["offset"])
    for p in ordered:
        if p["offset"] != expected:
            raise ShardLayoutError(
                f"{where}: rows {expected}..{p['offset']} along dim {dim} are in no rank's shard "
                "(or two shards overlap)"
            )
        expected += p[PIECE].shape[dim]
    if expected != head["shape"][dim]:
        raise ShardLayoutError(f"{where}: the shards cover {expected} of {head['shape'][dim]} rows along dim {dim}")
    return torch.cat([p[PIECE] for p in ordered], dim=dim)


def consolidate(shards: list, where: str = "state"):
    """The full (unsharded) state from the states of all ranks (same structure, in any order):
    pieces are joined, other values are taken from the first rank."""
    head = shards[0]
    if is_piece(head):
        if not all(is_piece(s) for s in shards):
            raise ShardLayoutError(f"{where}: sharded on some ranks, not on others")
        return _join(shards, where)
    if isinstance(head, dict):
        for s in shards[1:]:
            if not isinstance(s, dict) or s.keys() != head.keys():
                raise ShardLayoutError(f"{where}: the ranks' states hold different keys")
        return {k: consolidate([s[k] for s in shards], f"{where}.{k}") for k in head}
    if isinstance(head, (list, tuple)):
        if any(len(s) != len(head) for s in shards):
            raise ShardLayoutError(f"{where}: the ranks' states hold lists of different lengths")
        return type(head)(consolidate([s[i] for s in shards], f"{where}[{i}]") for i in range(len(head)))
    return head


def _from_piece_or_full(value, like, where: str):
    """A DTensor laid out like ``like`` from a piece of the same layout or from a full tensor."""
    from torch.distributed.tensor import DTensor

    dim = _shard_dim(like, where)
    mesh = like.device_mesh
    offset, length = chunk_bounds(like.shape[dim], mesh.size(), mesh.get_local_rank()) if dim is not None else (0, None)
    if is_piece(value):
        if list(value["shape"]) != list(like.shape) or value["dim"] != dim or value["offset"] != offset:
            raise ShardLayoutError(
                f"{where}: the stored piece (shape {value['shape']}, dim {value['dim']}, offset "
                f"{value['offset']}) does not match this rank's shard (shape {list(like.shape)}, "
                f"dim {dim}, offset {offset})"
            )
        local = value[PIECE]
    else:
        if tuple(value.shape) != tuple(like.shape):
            raise ShardLayoutError(f"{where}: stored shape {tuple(value.shape)} does not fit {tuple(like.shape)}")
        # a cut is copied so that the optimizer's state does not keep the full tensor alive
        local = value if dim is None else value.narrow(dim, offset, length).clone()
    local = local.to(device=like.device, dtype=like.dtype).contiguous()
    return DTensor.from_local(local, mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride())


def _fit(value, like, where: str):
    """``value`` as this rank holds it: a DTensor where the live state has one, else as stored."""
    if isinstance(like, _dtensor_type()):
        return _from_piece_or_full(value, like, where)
    if is_piece(value):
        raise ShardLayoutError(f"{where}: stored sharded but this model holds a plain tensor here")
    return value


def model_files_of(store: ckpt.CheckpointStore, step: int) -> list[str]:
    """The files of a committed checkpoint that hold its model state (see ``ckpt.model_files``)."""
    manifest = store.manifest(step)
    if manifest is None:
        raise FileNotFoundError(
            f"{store.ref(step).location} has no {ckpt.MANIFEST}: the checkpoint was never committed"
        )
    names = list(manifest.files)
    files = ckpt.model_files(names, manifest.world_size)
    if not files:
        raise ShardLayoutError(
            f"{store.ref(step).location}: no {ckpt.MODEL_SHARD} and not every rank's model shard "
            f"(world_size {manifest.world_size}, found pieces of ranks "
            f"{ckpt.model_shard_ranks(names)})"
        )
    return files


def load_full_state(store: ckpt.CheckpointStore, step: int, map_location="cpu") -> dict:
    """The full (unsharded) model state of a committed checkpoint — ``model``, ``optimizer``
    (indexed like ``Optimizer.state_dict``), ``scheduler``, ``step`` — whether it was written
    whole (DDP) or as per-rank pieces (FSDP, any world size). Holds every piece plus the
    joined tensors in memory at once (about twice the full state)."""
    files = model_files_of(store, step)
    states = [store.load_shard(step, name, map_location=map_location) for name in files]
    return states[0] if files == [ckpt.MODEL_SHARD] else consolidate(states)


def apply_sharded(model: nn.Module, optimizer: torch.optim.Optimizer | None, saved: dict) -> None:
    """Load ``saved`` ({"model", "optimizer"}: this rank's pieces, or full tensors from an
    unsharded or differently sharded checkpoint) into an FSDP2 model and, unless ``optimizer``
    is None, its optimizer. Full tensors are cut locally: no communication."""
    live = model.state_dict()
    missing = set(live) - set(saved["model"])
    if missing:
        raise ShardLayoutError(f"model state lacks {sorted(missing)[:5]} (the checkpoint is of another model)")
    model.load_state_dict({k: _fit(saved["model"][k], live[k], f"model.{k}") for k in live})
    if optimizer is None:
        return
    opt = saved["optimizer"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for idx, per_param in opt["state"].items():  # index i is the i-th parameter across the groups
        if int(idx) >= len(params):
            raise ShardLayoutError(f"optimizer state has parameter {idx}, the model only {len(params)}")
        like = params[int(idx)]
        # per-parameter moments have the parameter's shape and are sharded like it; scalars
        # (AdamW's step) are replicated plain tensors
        state[idx] = {
            k: _fit(v, like, f"optimizer.state.{idx}.{k}")
            if is_piece(v) or (isinstance(v, torch.Tensor) and v.dim())
            else v
            for k, v in per_param.items()
        }
    optimizer.load_state_dict({**opt, "state": state})
