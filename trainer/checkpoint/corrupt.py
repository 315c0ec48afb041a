"""The ``corrupt_checkpoint`` chaos drill, fired by the saver after a commit: silent corruption in
storage that only the validation gate's sha256 check can catch."""

from __future__ import annotations

from pathlib import Path

from trainer.checkpoint.store import step_name
from trainer.job.config import CorruptCheckpointDrill, Drill
from trainer.job.drills import claim
from trainer.job.events import EventKind


def corrupt_committed(drills: list[Drill], job_dir: str | Path, store, step: int, report) -> None:
    """The ``corrupt_checkpoint`` drill: after ``step`` is committed, flip one byte in the middle
    of its model state in storage (``model.pt``, or the first FSDP model shard; the manifest
    keeps the original sha256)."""
    for i, d in enumerate(drills):
        if isinstance(d, CorruptCheckpointDrill) and d.step == step and claim(job_dir, i):
            key = min(k for k in store.storage.list(f"{step_name(step)}/model") if k.endswith(".pt"))
            data = bytearray(store.storage.get_bytes(key))
            data[len(data) // 2] ^= 0xFF
            store.storage.put_bytes(key, bytes(data))
            report({"event": EventKind.CHAOS, "kind": d.kind, "step": step, "key": key})
