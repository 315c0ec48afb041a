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
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}


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

    @classmethod
    def of(cls, state) -> tuple["Layout", list[torch.Tensor]]:
        tensors: list[torch.Tensor] = []
        skeleton = flatten(state, tensors)
        entries, offset = [], 0
        for t in tensors:
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype not in _DTYPES:
                raise TypeError(f"unsupported dtype {t.dtype} in snapshot")
            nbytes = t.numel() * t.element_size()
            entries.append({"dtype": dtype, "shape": list(t.shape), "offset": offset, "nbytes": nbytes})
            offset = _align(offset + nbytes)
        return cls(skeleton, entries, offset), tensors

    def to_json(self) -> bytes:
        return json.dumps({"skeleton": self.skeleton, "entries": self.entries, "data_bytes": self.data_bytes}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Layout":
        d = json.loads(raw)
        return cls(d["skeleton"], d["entries"], d["data_bytes"])


def write_tensors(buf: memoryview, layout: Layout, tensors: list[torch.Tensor]) -> None:
    """Copy every tensor into ``buf`` (the data region) at its offset: the blocking part of a save."""
    for t, e in zip(tensors, layout.entries):
        if e["nbytes"]:
            dst = torch.frombuffer(buf, dtype=torch.uint8, count=e["nbytes"], offset=e["offset"])
            dst.view(t.dtype).view(t.shape).copy_(t.detach())


def read_state(buf: memoryview, layout: Layout, clone: bool = True):
    """The state stored in ``buf``; views into ``buf`` unless ``clone``."""
    tensors = []
    for e in layout.entries:
        dtype = _DTYPES[e["dtype"]]
        if e["nbytes"]:
            t = torch.frombuffer(buf, dtype=torch.uint8, count=e["nbytes"], offset=e["offset"]).view(dtype).view(e["shape"])
        else:
            t = torch.empty(e["shape"], dtype=dtype)
        tensors.append(t.clone() if clone else t)
    return unflatten(layout.skeleton, tensors)
