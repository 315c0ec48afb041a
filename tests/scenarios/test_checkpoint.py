"""Atomic checkpoint protocol, on a local directory and on a real S3 server (SeaweedFS):
what is never picked up, what survives, what is pruned."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tracemalloc
import uuid

import pytest
import torch

from support import s3_servers
from support.s3_servers import ACCESS_KEY, BUCKET, SECRET_KEY
from trainer.checkpoint.store import MANIFEST, CheckpointStore, rank_shard_name, step_name
from trainer.storage import LocalStorage
from trainer.storage.s3 import S3Storage

seaweed = s3_servers.seaweed


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> CheckpointStore:
    if request.param == "local":
        return CheckpointStore(LocalStorage(tmp_path / "ckpt"), str(tmp_path / "ckpt"))
    s3 = S3Storage(
        BUCKET,
        f"ckpt/{uuid.uuid4().hex[:10]}",
        endpoint_url=request.getfixturevalue("seaweed").endpoint,
        region="us-east-1",
        access_key=ACCESS_KEY,
        secret_key=SECRET_KEY,
    )
    return CheckpointStore(s3, s3.url)


def _save(s: CheckpointStore, step, value=1.0, commit=True):
    shards = [
        s.write_shard(step, "model.pt", {"w": torch.full((4,), value), "step": step}),
        s.write_shard(step, rank_shard_name(0), {"consumed": step * 8}),
    ]
    return s.commit(step, shards, {"stage": "s"}) if commit else shards


def _flip_byte(s: CheckpointStore, key: str, at: int = -10) -> None:
    data = bytearray(s.storage.get_bytes(key))
    data[at] ^= 0xFF
    s.storage.put_bytes(key, bytes(data))


def test_round_trip_is_bit_exact(store):
    w = torch.randn(16, 16)
    ref = store.commit(3, [store.write_shard(3, "model.pt", {"w": w})], {})
    assert store.latest_complete() == ref and ref.location.endswith("/step_00000003")
    assert torch.equal(store.load_shard(3, "model.pt")["w"], w)
    other, step = CheckpointStore.of_step(
        ref.location,
        None
        if isinstance(store.storage, LocalStorage)
        else {"endpoint_url": store.storage.endpoint_url, "access_key": ACCESS_KEY, "secret_key": SECRET_KEY},
    )
    assert step == 3 and other.verify(3) == []


def test_checkpoint_without_pointer_is_ignored(store):
    _save(store, 4)
    _save(store, 8, commit=False)  # shards written, no manifest, no pointer
    assert store.latest_complete().step == 4
    assert store.verify(8) == ["step_00000008: no manifest.json (checkpoint was never committed)"]


def test_corrupt_shard_falls_back_to_previous_checkpoint(store):
    _save(store, 4, 4.0)
    _save(store, 8, 8.0)
    _flip_byte(store, f"{step_name(8)}/model.pt")  # one flipped byte
    assert "sha256 does not match" in " ".join(store.verify(8))
    assert store.latest_complete().step == 4


def test_truncated_shard_is_detected(store):
    _save(store, 4)
    key = f"{step_name(4)}/model.pt"
    store.storage.put_bytes(key, store.storage.get_bytes(key)[:20])
    assert "bytes, manifest says" in " ".join(store.verify(4))
    assert store.latest_complete() is None


def test_checkpoint_marked_bad_is_never_resumed_from(store):
    _save(store, 4)
    _save(store, 8)
    store.set_verdict(8, {"verdict": "bad", "problems": ["diverged"]})
    assert store.latest_complete().step == 4


def test_prune_keeps_last_k_the_pointer_target_and_the_good_one(store):
    for step in (2, 4, 6, 8):
        _save(store, step)
    _save(store, 10, commit=False)
    store.set_verdict(2, {"verdict": "good"})
    assert store.prune(keep=2) == [4]
    assert store.committed_steps() == [8, 6, 2]
    assert store.storage.exists(f"{step_name(10)}/model.pt")  # newer than the pointer: a save in progress
    assert store.prune(keep=1, protect={6}) == []


class _PrunedWhileRead:
    """A checkpoint store's storage while retention prunes concurrently: every object is
    deleted right after its size was read (between the size and the sha256 check)."""

    def __init__(self, storage):
        self._storage = storage

    def __getattr__(self, name):
        return getattr(self._storage, name)

    def size(self, key: str) -> int:
        n = self._storage.size(key)
        self._storage.delete(key)
        return n


def test_shards_deleted_during_verify_read_as_missing(store):
    _save(store, 4)
    racing = CheckpointStore(_PrunedWhileRead(store.storage), store.location)
    assert racing.verify(4) == [f"{step_name(4)}/model.pt: missing", f"{step_name(4)}/{rank_shard_name(0)}: missing"]


def test_verify_hashes_a_large_shard_without_holding_it_in_memory(store):
    """The sha256 of a 48 MiB shard is computed from a stream: the verifier's peak heap stays a
    fraction of the shard (it held the whole object on S3 before)."""
    shards = [
        store.write_shard(4, "model.pt", {"w": torch.randn(12 * 2**20)}),
        store.write_shard(4, rank_shard_name(0), {"consumed": 4}),
    ]
    store.commit(4, shards, {})
    assert store.verify(4) == []  # warm (boto3 client, imports) before measuring
    _flip_byte(store, f"{step_name(4)}/model.pt")
    tracemalloc.start()
    try:
        problems = store.verify(4)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert problems == [f"{step_name(4)}/model.pt: sha256 does not match the manifest"]
    assert peak < shards[0]["bytes"] // 4, f"peak {peak} bytes for a {shards[0]['bytes']}-byte shard"


def test_prune_uncommits_before_it_deletes(store):
    """A prune killed midway leaves no step that still looks committed but lacks shards."""
    for step in (2, 4):
        _save(store, step)

    class _KilledAfterFirstDelete(_PrunedWhileRead):
        def delete_prefix(self, prefix):
            raise KeyboardInterrupt  # the process dies here

    pruning = CheckpointStore(_KilledAfterFirstDelete(store.storage), store.location)
    with pytest.raises(KeyboardInterrupt):
        pruning.prune(keep=1)
    assert store.committed_steps() == [4] and store.latest_complete().step == 4


def test_writer_killed_after_manifest_before_pointer(tmp_path):
    """A real process commits step 4, writes every shard and the manifest of step 8, and is
    SIGKILLed before it moves the pointer: step 8 must never be picked up."""
    script = textwrap.dedent(f"""
        import sys, torch
        from trainer.checkpoint.store import CheckpointStore, MANIFEST, step_name
        s = CheckpointStore.open({str(tmp_path)!r})
        for step in (4, 8):
            shards = [s.write_shard(step, "model.pt", {{"w": torch.full((4,), float(step))}})]
            if step == 4:
                s.commit(step, shards, {{}})
            else:
                s.write_json(f"{{step_name(8)}}/{{MANIFEST}}", {{"step": 8, "files": {{x["name"]: x for x in shards}}}})
        print("manifest-written", flush=True)
        sys.stdin.read()  # blocks until killed: the pointer is never moved
        s.commit(8, shards, {{}})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "manifest-written"
    proc.kill()
    proc.wait()
    s = CheckpointStore.open(tmp_path)
    assert s.storage.exists(f"{step_name(8)}/{MANIFEST}")
    ref = s.latest_complete()
    assert ref.step == 4
    assert torch.equal(s.load_shard(4, "model.pt")["w"], torch.full((4,), 4.0))
