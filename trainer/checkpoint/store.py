"""Atomic checkpoints in a storage backend: shards, a manifest with their sha256, the pointer last.

Layout of one stage's checkpoint location (a local directory or an ``s3://bucket/prefix``)::

    step_00000020/model.pt          model, optimizer, scheduler (rank 0; DDP replicas are equal)
    step_00000020/model_shard_00000.pt   … or, under FSDP, each rank's piece of them (``trainer.checkpoint.sharded``)
    step_00000020/rank_00000.pt     per-rank state: RNG, data position
    step_00000020/node_*.json       a saver's record of the shards it persisted
    step_00000020/manifest.json     sha256 + size of every shard; written after all shards
    step_00000020/verdict.json      validation result (good / bad, with the reasons)
    latest                          {"step": 20, "dir": "step_00000020"}; written last
    good                            the newest checkpoint that passed validation
    quarantine/step_00000040.<time>/  a bad checkpoint moved aside when training rewound past it

Only a checkpoint at or before the pointer, whose manifest exists and whose shards match it,
is ever loaded. A save killed at any point leaves the previous checkpoint as the resume point.
A checkpoint is named by its *location*: ``<stage location>/step_XXXXXXXX``.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.checkpoint import records
from trainer.checkpoint.hashing import HashingWriter
from trainer.checkpoint.records import DamagedRecord, Manifest
from trainer.storage import NotAFile, NotFound, Storage, open_storage

if TYPE_CHECKING:  # torch is imported where shards are written or read: `pretrain status` lists checkpoints without it
    import torch

POINTER = "latest"
GOOD = "good"
MANIFEST = "manifest.json"
VERDICT = "verdict.json"
_STEP = re.compile(r"^step_(\d{8})$")


def step_name(step: int) -> str:
    return f"step_{step:08d}"


MODEL_SHARD = "model.pt"  # the full model state: model, optimizer, scheduler, step
_MODEL_PIECE = re.compile(r"^model_shard_(\d{5})\.pt$")


def rank_shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def model_shard_name(rank: int) -> str:
    """One rank's piece of a sharded (FSDP) model state."""
    return f"model_shard_{rank:05d}.pt"


def model_shard_ranks(names) -> list[int]:
    """The ranks whose model pieces are among the file ``names`` (sorted)."""
    return sorted(int(m.group(1)) for n in names if (m := _MODEL_PIECE.match(n)))


def model_files(names, world_size: int) -> list[str]:
    """The files holding the model state among ``names``: ``model.pt``, or the pieces of
    ranks ``0..world_size-1``. An empty list means the model state is incomplete."""
    if MODEL_SHARD in names:
        return [MODEL_SHARD]
    if model_shard_ranks(names) == list(range(world_size)):
        return [model_shard_name(r) for r in range(world_size)]
    return []


def _join(location: str, name: str) -> str:
    return f"{location.rstrip('/')}/{name}"


@dataclass(frozen=True)
class CheckpointRef:
    step: int
    location: str  # local directory path or s3:// URL of the step

    @property
    def path(self) -> Path:
        """The step directory (local checkpoints only)."""
        return Path(self.location)

    def to_dict(self) -> dict:
        return {"step": self.step, "path": self.location}


class CheckpointStore:
    """One stage's checkpoints in a :class:`Storage`."""

    def __init__(self, storage: Storage, location: str):
        self.storage, self.location = storage, location

    @classmethod
    def open(cls, location: str | Path, options: dict | None = None) -> CheckpointStore:
        location = os.fspath(location)
        return cls(open_storage(location, **(options or {})), location)

    @classmethod
    def of_step(cls, step_location: str | Path, options: dict | None = None) -> tuple[CheckpointStore, int]:
        """The store holding the checkpoint at ``step_location``, and its step."""
        parent, _, name = os.fspath(step_location).rstrip("/").rpartition("/")
        m = _STEP.match(name)
        if not m:
            raise ValueError(f"{step_location} is not a checkpoint location (…/step_XXXXXXXX)")
        return cls.open(parent or ".", options), int(m.group(1))

    def ref(self, step: int) -> CheckpointRef:
        return CheckpointRef(step, _join(self.location, step_name(step)))

    # ---- small JSON records (schemas and encoders: trainer.checkpoint.records) ---------------------------
    def _read(self, key: str, parse):
        """``parse(key, bytes)`` of the object at ``key``; None if there is none."""
        try:
            data = self.storage.get_bytes(key)
        except NotFound:
            return None
        except NotAFile:
            raise records.DamagedRecord(key, "a directory, not a file") from None
        return parse(key, data)

    def read_json(self, key: str) -> dict | None:
        """Any JSON object kept in the store (not a checkpoint record); DamagedRecord if unreadable."""
        return self._read(key, records.load_object)

    def write_json(self, key: str, obj: dict) -> None:
        self.storage.put_bytes(key, records.encode_object(obj))

    def _write_pointer(self, name: str, step: int) -> None:
        """The one writer of the ``latest`` and ``good`` pointers."""
        self.storage.put_bytes(name, records.encode_pointer(step))

    # ---- writing -------------------------------------------------------------------------
    def write_shard(self, step: int, name: str, obj: object) -> dict:
        """Durably write one shard, streaming ``torch.save`` through a sha256 straight into
        storage (no in-memory copy of the state, no temporary file for S3). Returns its
        manifest entry."""
        import torch

        with ThreadPoolExecutor(1, thread_name_prefix="sha256") as pool:
            written: list[HashingWriter] = []

            def write(f) -> None:
                written.append(out := HashingWriter(f, pool))
                torch.save(obj, out)

            self.storage.put_stream(f"{step_name(step)}/{name}", write)
        return {"name": name, "sha256": written[0].sha.hexdigest(), "bytes": written[0].bytes}

    def write_node_record(self, step: int, node: str, world_size: int, shards: list[dict]) -> None:
        self.storage.put_bytes(f"{step_name(step)}/node_{node}.json", records.encode_node_record(world_size, shards))

    def _node_keys(self, step: int) -> list[str]:
        return [k for k in self.storage.list(f"{step_name(step)}/node_") if k.endswith(".json")]

    def node_shards(self, step: int) -> list[dict]:
        """The shards the nodes' savers recorded for ``step``. A damaged node record counts as
        not written: that step is never committed (verify reports it if it was)."""
        shards = []
        for key in self._node_keys(step):
            try:
                shards += (self._read(key, records.parse_node_record) or records.NodeRecord(1, [])).shards
            except DamagedRecord:
                continue
        return shards

    def commit(self, step: int, shards: list[dict], meta: dict) -> CheckpointRef:
        """Write the manifest (all shards are already durable), then move the pointer."""
        self.storage.put_bytes(
            f"{step_name(step)}/{MANIFEST}", records.encode_manifest(step, shards, {"created": time.time(), **meta})
        )
        self._write_pointer(POINTER, step)
        return self.ref(step)

    # ---- reading -------------------------------------------------------------------------
    def read_pointer(self, name: str = POINTER) -> int | None:
        """The step a pointer names; None if there is none. A damaged ``latest`` is replaced by
        the newest step that holds a manifest (what the pointer said unless a commit was torn
        between manifest and pointer); a damaged ``good`` is ignored: ``latest_good`` is
        recomputed from the verdicts and the next good verdict writes it anew.
        ``pointer_problems`` reports either."""
        try:
            ptr = self._read(name, records.parse_pointer)
        except DamagedRecord:
            return max(self._manifest_steps(), default=None) if name == POINTER else None
        return None if ptr is None else ptr.step

    def pointer_problems(self) -> list[str]:
        """What is wrong with the stage's pointers, and what is done about it."""
        notes = []
        for name in (POINTER, GOOD):
            try:
                self._read(name, records.parse_pointer)
            except DamagedRecord as err:
                if name == POINTER:
                    derived = max(self._manifest_steps(), default=None)
                    notes.append(
                        f"{err}: treated as step {derived} (the newest step with a {MANIFEST}); "
                        "the next commit or resume writes it anew"
                    )
                else:
                    notes.append(
                        f"{err}: ignored (the good checkpoint is recomputed from the verdicts; "
                        "the next good verdict writes it anew)"
                    )
        return notes

    def record_problems(self) -> list[str]:
        """Every damaged record of the stage, each with what is done about it (``pretrain status``)."""
        notes = self.pointer_problems()
        for step in self.all_steps():
            try:
                self._checked_manifest(step)
            except DamagedRecord as err:
                notes.append(
                    f"{err}: the checkpoint is unusable; the validation gate judges it bad and the stage "
                    "rewinds past it"
                )
            try:
                self._read(f"{step_name(step)}/{VERDICT}", records.parse_verdict)
            except DamagedRecord as err:
                notes.append(f"{err}: the step is unjudged again; the next gate pass judges it")
        return notes

    def _checked_manifest(self, step: int) -> Manifest | None:
        """The step's manifest, having read its node records too; DamagedRecord for either."""
        manifest = self.manifest(step)
        for key in self._node_keys(step):
            self._read(key, records.parse_node_record)
        return manifest

    def _manifest_steps(self) -> set[int]:
        """Steps whose directory holds a ``manifest.json`` (readable or not)."""
        steps = set()
        for key in self.storage.list("step_"):
            head, _, tail = key.partition("/")
            if (m := _STEP.match(head)) and tail == MANIFEST:
                steps.add(int(m.group(1)))
        return steps

    def manifest(self, step: int) -> Manifest | None:
        """The step's manifest; None if it has none; DamagedRecord if it cannot be read."""
        return self._read(f"{step_name(step)}/{MANIFEST}", lambda key, data: records.parse_manifest(key, data, step))

    def committed_steps(self) -> list[int]:
        """Steps at or before the pointer that hold a manifest (readable or not), newest first."""
        limit = self.read_pointer()
        if limit is None:
            return []
        return sorted((s for s in self._manifest_steps() if s <= limit), reverse=True)

    def all_steps(self) -> list[int]:
        return sorted({int(m.group(1)) for k in self.storage.list("step_") if (m := _STEP.match(k.partition("/")[0]))})

    def verify(self, step: int, deep: bool = True) -> list[str]:
        """Problems that make the checkpoint unusable (empty list: complete). A damaged manifest
        or node record is one of them."""
        name = step_name(step)
        try:
            manifest = self._checked_manifest(step)
        except DamagedRecord as err:
            return [str(err)]
        if manifest is None:
            return [f"{name}: no {MANIFEST} (checkpoint was never committed)"]
        problems = []
        for fname, entry in manifest.files.items():
            key = f"{name}/{fname}"
            try:
                size = self.storage.size(key)
            except NotFound:
                problems.append(f"{name}/{fname}: missing")
                continue
            except NotAFile:
                problems.append(f"{name}/{fname}: a directory, not a file")
                continue
            if size != entry.bytes:
                problems.append(f"{name}/{fname}: {size} bytes, manifest says {entry.bytes}")
            elif deep and (digest := self._sha256(key)) != entry.sha256:
                problems.append(
                    f"{name}/{fname}: " + ("missing" if digest is None else "sha256 does not match the manifest")
                )
        return problems

    def _sha256(self, key: str) -> str | None:
        """The object's sha256, streamed (never the whole object in memory); None if it is gone
        (deleted while being verified)."""
        h = hashlib.sha256()
        try:
            for block in self.storage.iter_bytes(key):
                h.update(block)
        except NotFound:
            return None
        return h.hexdigest()

    def latest_complete(self) -> CheckpointRef | None:
        """The newest committed checkpoint whose shards verify and that is not marked bad."""
        for step in self.committed_steps():
            if not self.verify(step) and (self.verdict(step) or {}).get("verdict") != "bad":
                return self.ref(step)
        return None

    def load_shard(self, step: int, name: str, map_location: str | torch.device = "cpu") -> dict:
        """Load one shard with ``weights_only=True`` (tensors and plain containers only)."""
        import torch

        key = f"{step_name(step)}/{name}"
        local = self.storage.local_path(key)
        if local is not None:
            return torch.load(local, map_location=map_location, weights_only=True)
        with tempfile.TemporaryDirectory(prefix="pretrain-ckpt-") as tmp:
            self.storage.get_file(key, Path(tmp) / name)
            return torch.load(Path(tmp) / name, map_location=map_location, weights_only=True)

    # ---- verdicts and retention -------------------------------------------------------------
    def verdict(self, step: int) -> dict | None:
        """The gate's verdict on ``step``; None if it has none, or if its record is damaged (the
        step is unjudged again: the next gate pass judges it and writes a new one)."""
        try:
            return self._read(f"{step_name(step)}/{VERDICT}", records.parse_verdict)
        except DamagedRecord:
            return None

    def latest_good(self) -> CheckpointRef | None:
        """The newest committed checkpoint that passed validation (and whose files are all there)."""
        for step in self.committed_steps():
            if (self.verdict(step) or {}).get("verdict") == "good" and not self.verify(step, deep=False):
                return self.ref(step)
        return None

    def unjudged(self) -> list[int]:
        """Steps the validation gate still has to judge, oldest first: committed ones without a
        verdict, and the pointer's target whatever state it is in (a pointer to a checkpoint
        whose manifest has gone is a damaged checkpoint, not an uncommitted one)."""
        limit = self.read_pointer()
        steps = {s for s in self.committed_steps() if self.verdict(s) is None}
        if limit is not None and self.verdict(limit) is None:
            steps.add(limit)
        return sorted(steps)

    def quarantine(self, step: int) -> str:
        """Move a bad checkpoint out of the way (kept for forensics under ``quarantine/``), so
        training can commit that step again. Returns its new location."""
        dest = f"quarantine/{step_name(step)}.{time.strftime('%Y%m%dT%H%M%S')}.{time.time_ns() % 10**6:06d}"
        self.storage.move_prefix(step_name(step), dest)
        return _join(self.location, dest)

    def rewind(self, step: int | None) -> None:
        """Move the ``latest`` pointer back to ``step`` (None: no checkpoint). Only the
        orchestrator does this, between jobs, after quarantining what lay beyond it."""
        if step is None:
            self.storage.delete(POINTER)
        else:
            self._write_pointer(POINTER, step)
        good = self.read_pointer(GOOD)
        if good is None or step is None or good > step:  # (None: absent, or damaged)
            self.storage.delete(GOOD)

    def set_verdict(self, step: int, record: dict) -> None:
        self.storage.put_bytes(f"{step_name(step)}/{VERDICT}", records.encode_verdict(record))
        if record.get("verdict") == "good" and step >= (self.read_pointer(GOOD) or -1):
            self._write_pointer(GOOD, step)

    def prune(self, keep: int, protect: set[int] = frozenset()) -> list[int]:
        """Delete committed checkpoints beyond the newest ``keep`` (never the pointer's target,
        the good one, a bad one (kept for forensics) or a protected step) and uncommitted
        leftovers older than the pointer."""
        limit = self.read_pointer()
        if limit is None:
            return []
        good = self.read_pointer(GOOD)
        committed = self.committed_steps()
        kept = set(committed[:keep]) | {limit} | set(protect) | ({good} if good is not None else set())
        bad = {s for s in committed if s not in kept and (self.verdict(s) or {}).get("verdict") == "bad"}  # forensics
        deleted = [s for s in self.all_steps() if s <= limit and s not in kept | bad]
        for step in deleted:  # the manifest first: a half-deleted step is never "committed"
            self.storage.delete(f"{step_name(step)}/{MANIFEST}")
            self.storage.delete_prefix(step_name(step))
        return deleted


def stage_store(job) -> CheckpointStore:
    """The checkpoint store of a job's stage (``job``: a ``trainer.job.config.JobConfig``): a local
    directory or an S3 prefix."""
    return CheckpointStore.open(job.checkpoint.location, job.checkpoint.options)
