"""Atomic checkpoint protocol: what is never picked up, what survives, what is pruned."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from trainer import checkpoint as ckpt


def _save(d, step, value=1.0, commit=True):
    shards = [ckpt.write_shard(d, step, "model.pt", {"w": torch.full((4,), value), "step": step}),
              ckpt.write_shard(d, step, ckpt.rank_shard_name(0), {"consumed": step * 8})]
    return ckpt.commit(d, step, shards, {"stage": "s"}) if commit else shards


def test_round_trip_is_bit_exact(tmp_path):
    w = torch.randn(16, 16)
    ref = ckpt.commit(tmp_path, 3, [ckpt.write_shard(tmp_path, 3, "model.pt", {"w": w})], {})
    assert ckpt.latest_complete(tmp_path) == ref
    assert torch.equal(ckpt.load_shard(ref.path, "model.pt")["w"], w)


def test_checkpoint_without_pointer_is_ignored(tmp_path):
    _save(tmp_path, 4)
    _save(tmp_path, 8, commit=False)  # shards written, no manifest, no pointer
    assert ckpt.latest_complete(tmp_path).step == 4
    assert ckpt.verify(ckpt.step_dir(tmp_path, 8)) == ["step_00000008: no manifest.json (checkpoint was never committed)"]


def test_writer_killed_after_manifest_before_pointer(tmp_path):
    """A real process commits step 4, writes every shard and the manifest of step 8, and is
    SIGKILLed before it moves the pointer: step 8 must never be picked up."""
    script = textwrap.dedent(f"""
        import sys, torch
        from trainer import checkpoint as ckpt
        from trainer.atomic import atomic_write_json
        d = {str(tmp_path)!r}
        for step in (4, 8):
            shards = [ckpt.write_shard(d, step, "model.pt", {{"w": torch.full((4,), float(step))}})]
            if step == 4:
                ckpt.commit(d, step, shards, {{}})
            else:
                atomic_write_json(ckpt.step_dir(d, step) / ckpt.MANIFEST,
                                  {{"step": 8, "files": {{s["name"]: s for s in shards}}}})
        print("manifest-written", flush=True)
        sys.stdin.read()  # blocks until killed: the pointer is never moved
        ckpt.commit(d, 8, shards, {{}})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "manifest-written"
    proc.kill()
    proc.wait()
    assert (ckpt.step_dir(tmp_path, 8) / ckpt.MANIFEST).exists()
    ref = ckpt.latest_complete(tmp_path)
    assert ref.step == 4
    assert torch.equal(ckpt.load_shard(ref.path, "model.pt")["w"], torch.full((4,), 4.0))


def test_corrupt_shard_falls_back_to_previous_checkpoint(tmp_path):
    _save(tmp_path, 4, 4.0)
    ref = _save(tmp_path, 8, 8.0)
    data = bytearray((ref.path / "model.pt").read_bytes())
    data[-10] ^= 0xFF  # one flipped byte
    (ref.path / "model.pt").write_bytes(bytes(data))
    assert "sha256 does not match" in " ".join(ckpt.verify(ref.path))
    assert ckpt.latest_complete(tmp_path).step == 4


def test_truncated_shard_is_detected(tmp_path):
    ref = _save(tmp_path, 4)
    (ref.path / "model.pt").write_bytes((ref.path / "model.pt").read_bytes()[:20])
    assert "bytes, manifest says" in " ".join(ckpt.verify(ref.path))
    assert ckpt.latest_complete(tmp_path) is None


def test_prune_keeps_last_k_and_the_pointer_target(tmp_path):
    for step in (2, 4, 6, 8):
        _save(tmp_path, step)
    _save(tmp_path, 10, commit=False)
    assert ckpt.prune(tmp_path, keep=2) == [2, 4]
    assert ckpt.committed_steps(tmp_path) == [8, 6]
    assert ckpt.step_dir(tmp_path, 10).exists()  # newer than the pointer: a save in progress
    assert ckpt.prune(tmp_path, keep=1, protect={6}) == []
