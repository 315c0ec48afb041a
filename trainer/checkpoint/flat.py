"""A flat, pickle-free layout for a nested state dict: tensor bytes laid end to end plus a
small JSON record (structure, dtypes, shapes, offsets, and the non-tensor leaves).

Used for shared-memory snapshots: saving is one ``copy_`` per tensor into a pre-allocated
buffer, loading is a zero-copy view of the buffer (callers clone what they keep).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

ALIGN = 64
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def flatten(obj, tensors: list[torch.Tensor]):
    """JSON-able skeleton of ``obj``; tensors are appended to ``tensors`` and referenced by index."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"__t": len(tensors) - 1}
    if isinstance(obj, dict):
        return {"__d": [[flatten(k, tensors), flatten(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple": [flatten(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [flatten(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot snapshot a {type(obj).__name__} (only tensors, containers and scalars)")


def unflatten(skel, tensors: list[torch.Tensor]):
    if isinstance(skel, dict):
        if "__t" in skel:
            return tensors[skel["__t"]]
        if "__d" in skel:
            return {unflatten(k, tensors): unflatten(v, tensors) for k, v in skel["__d"]}
        return tuple(unflatten(v, tensors) for v in skel["__tuple"])
    if isinstance(skel, list):
        return [unflatten(v, tensors) for v in skel]
    return skel


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a state lives in the data region."""

    skeleton: object
    entries: list[dict]  # dtype, shape, offset, nbytes
    data_bytes: int
    signature: tuple = ()  # (dtype, shape) of each tensor, in order: what ``entries`` follow from
    entries_json: bytes = b""  # ``entries`` encoded once, for every later state of the same signature

    @classmethod
    def of(cls, state, like: Layout | None = None) -> tuple[Layout, list[torch.Tensor]]:
        """The layout of ``state`` and its tensors in layout order. ``like``: the layout of an
        earlier state; when this one's tensors have the same dtypes and shapes (every snapshot of
        a training run does) its entries are reused, not computed and encoded again."""
        tensors: list[torch.Tensor] = []
        skeleton = flatten(state, tensors)
        signature = tuple((t.dtype, t.shape) for t in tensors)
        if like is not None and like.signature == signature:
            return cls(skeleton, like.entries, like.data_bytes, signature, like.entries_json), tensors
        entries, offset = [], 0
        for t in tensors:
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype not in _DTYPES:
                raise TypeError(f"unsupported dtype {t.dtype} in snapshot")
            nbytes = t.numel() * t.element_size()
            entries.append({"dtype": dtype, "shape": list(t.shape), "offset": offset, "nbytes": nbytes})
            offset = _align(offset + nbytes)
        return cls(skeleton, entries, offset, signature, json.dumps(entries).encode()), tensors

    def to_json(self) -> bytes:
        entries = self.entries_json or json.dumps(self.entries).encode()
        return b'{"skeleton": %s, "entries": %s, "data_bytes": %d}' % (
            json.dumps(self.skeleton).encode(),
            entries,
            self.data_bytes,
        )

    @classmethod
    def from_json(cls, raw: bytes) -> Layout:
        d = json.loads(raw)
        return cls(d["skeleton"], d["entries"], d["data_bytes"])


def views(buf: memoryview, layout: Layout) -> list[torch.Tensor]:
    """A tensor over ``buf`` (the data region) where each of ``layout``'s tensors lies (an empty
    tensor of its shape where it has no bytes). They hold ``buf``'s memory while they live."""
    out = []
    for e in layout.entries:
        dtype = _DTYPES[e["dtype"]]
        if e["nbytes"]:
            out.append(
                torch.frombuffer(buf, dtype=torch.uint8, count=e["nbytes"], offset=e["offset"])
                .view(dtype)
                .view(e["shape"])
            )
        else:
            out.append(torch.empty(e["shape"], dtype=dtype))
    return out


def copy_into(destinations: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    """Copy each tensor into its destination (``views``): the blocking part of a save."""
    with torch.no_grad():
        for dst, t in zip(destinations, tensors):
            dst.copy_(t)


def write_tensors(buf: memoryview, layout: Layout, tensors: list[torch.Tensor]) -> None:
    """Copy every tensor into ``buf`` (the data region) at its offset."""
    copy_into(views(buf, layout), tensors)


def read_state(buf: memoryview, layout: Layout, clone: bool = True):
    """The state stored in ``buf``; views into ``buf`` unless ``clone``."""
    tensors = views(buf, layout)
    return unflatten(layout.skeleton, [t.clone() for t in tensors] if clone else tensors)
