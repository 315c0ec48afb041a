"""Atomic checkpoints: shards, then a manifest with their sha256, then the pointer, last.

Layout of one stage's checkpoint directory::

    step_00000020/model.pt          model, optimizer, scheduler (rank 0; DDP replicas are equal)
    step_00000020/rank_00000.pt     per-rank state: RNG, data position
    step_00000020/manifest.json     sha256 + size of every shard; written after all shards
    latest                          {"step": 20, "dir": "step_00000020"}; written last

Only a checkpoint at or before the pointer, whose manifest exists and whose shards match it,
is ever loaded. A save killed at any point leaves the previous checkpoint as the resume point.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.atomic import atomic_write_json, fsync_dir, read_json, sha256_file

POINTER = "latest"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir(ckpt_dir: str | Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{step:08d}"


def rank_shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


@dataclass(frozen=True)
class CheckpointRef:
    step: int
    path: Path

    def to_dict(self) -> dict:
        return {"step": self.step, "path": str(self.path)}


class _HashingWriter:
    """A file wrapper that hashes and counts what ``torch.save`` streams through it."""

    def __init__(self, f):
        self.f, self.sha, self.bytes = f, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.sha.update(b)
        self.bytes += len(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


def write_shard(ckpt_dir: str | Path, step: int, name: str, obj: object) -> dict:
    """Durably write one shard, streaming ``torch.save`` into the file (no in-memory copy):
    temporary name, fsync, rename, fsync the directory. Returns its manifest entry."""
    path = step_dir(ckpt_dir, step) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        out = _HashingWriter(f)
        torch.save(obj, out)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return {"name": name, "sha256": out.sha.hexdigest(), "bytes": out.bytes}


def commit(ckpt_dir: str | Path, step: int, shards: list[dict], meta: dict) -> CheckpointRef:
    """Write the manifest (all shards are already durable), then move the pointer."""
    d = step_dir(ckpt_dir, step)
    manifest = {"step": step, "files": {s["name"]: {"sha256": s["sha256"], "bytes": s["bytes"]} for s in shards},
                "created": time.time(), **meta}
    atomic_write_json(d / MANIFEST, manifest)
    atomic_write_json(Path(ckpt_dir) / POINTER, {"step": step, "dir": d.name})
    return CheckpointRef(step, d)


def read_pointer(ckpt_dir: str | Path) -> int | None:
    ptr = read_json(Path(ckpt_dir) / POINTER)
    return None if ptr is None else int(ptr["step"])


def verify(path: str | Path, deep: bool = True) -> list[str]:
    """Problems that make the checkpoint at ``path`` unusable (empty list: complete)."""
    path = Path(path)
    manifest = read_json(path / MANIFEST)
    if manifest is None:
        return [f"{path.name}: no {MANIFEST} (checkpoint was never committed)"]
    problems = []
    for name, entry in manifest["files"].items():
        f = path / name
        if not f.is_file():
            problems.append(f"{path.name}/{name}: missing")
        elif f.stat().st_size != entry["bytes"]:
            problems.append(f"{path.name}/{name}: {f.stat().st_size} bytes, manifest says {entry['bytes']}")
        elif deep and sha256_file(f) != entry["sha256"]:
            problems.append(f"{path.name}/{name}: sha256 does not match the manifest")
    return problems


def committed_steps(ckpt_dir: str | Path) -> list[int]:
    """Steps of checkpoint directories at or before the pointer that hold a manifest, newest first."""
    limit = read_pointer(ckpt_dir)
    if limit is None:
        return []
    steps = []
    for child in Path(ckpt_dir).iterdir():
        m = _STEP_DIR.match(child.name)
        if m and int(m.group(1)) <= limit and (child / MANIFEST).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps, reverse=True)


def latest_complete(ckpt_dir: str | Path) -> CheckpointRef | None:
    """The newest committed checkpoint whose shards verify; None if there is none."""
    if not Path(ckpt_dir).is_dir():
        return None
    for step in committed_steps(ckpt_dir):
        if not verify(step_dir(ckpt_dir, step)):
            return CheckpointRef(step, step_dir(ckpt_dir, step))
    return None


def load_shard(path: str | Path, name: str, map_location: str | torch.device = "cpu") -> dict:
    """Load one shard with ``weights_only=True`` (tensors and plain containers only)."""
    return torch.load(Path(path) / name, map_location=map_location, weights_only=True)


def prune(ckpt_dir: str | Path, keep: int, protect: set[int] = frozenset()) -> list[int]:
    """Delete committed checkpoints beyond the newest ``keep`` (never the pointer's target or
    a protected step) and uncommitted leftovers older than the pointer. Returns deleted steps."""
    limit = read_pointer(ckpt_dir)
    if limit is None:
        return []
    kept = set(committed_steps(ckpt_dir)[:keep]) | {limit} | set(protect)
    deleted = []
    for child in Path(ckpt_dir).iterdir():
        m = _STEP_DIR.match(child.name)
        if m and int(m.group(1)) <= limit and int(m.group(1)) not in kept:
            shutil.rmtree(child, ignore_errors=True)
            deleted.append(int(m.group(1)))
    return sorted(deleted)
