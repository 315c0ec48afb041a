"""Disk full (ENOSPC) on a real, small tmpfs: no torn file, the previous state stays good, a
clear message naming the file system, the bytes needed and the setting to change."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from pretrain.run.incidents import NON_RETRYABLE, cause_of
from pretrain.state.ledger import Ledger, LedgerDiskFull
from support.agents import agent_job, run_agent, snapshot
from support.campaigns import small_spec
from support.tmpfs import small_tmpfs
from trainer.checkpoint import store as ckpt
from trainer.checkpoint.saver import CheckpointDiskFull, Saver
from trainer.common.atomic import atomic_write_bytes
from trainer.job.reporting import EVENTS, METRICS, read_all


def test_atomic_write_that_fills_the_disk_leaves_the_old_file_and_no_temporary(tmp_path):
    with small_tmpfs(tmp_path / "fs", "1m") as fs:
        target = fs / "latest"
        atomic_write_bytes(target, b'{"step": 4}')
        with pytest.raises(OSError) as err:
            atomic_write_bytes(target, b"x" * (2 << 20))
        assert err.value.errno == errno.ENOSPC
        assert target.read_bytes() == b'{"step": 4}'
        assert sorted(p.name for p in fs.iterdir()) == ["latest"]  # no .latest.tmp-<pid> left


def files_under(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_a_persist_that_fills_the_disk_takes_back_its_shards_and_says_what_to_change(tmp_path):
    with small_tmpfs(tmp_path / "fs", "1m") as fs:
        location = ckpt.CheckpointStore.open(fs / "s")
        saver = Saver(tmp_path / "shm", 1, location, keep=2, events=None)
        snapshot(tmp_path / "shm", 4)
        assert saver.persist(4) and location.read_pointer() == 4
        before = files_under(fs)
        snapshot(tmp_path / "shm", 8, numel=512 << 10)  # 2 MiB of model: cannot fit
        with pytest.raises(CheckpointDiskFull) as err:
            saver.persist(8)
        message = str(err.value)
        assert f"no space left on {fs} (tmpfs" in message and "for checkpoint step 8" in message
        assert "needs about 2.0 MiB" in message and "lower checkpoint.keep (now 2)" in message
        assert "step 4) stays the resume point" in message
        assert [
            f for f in files_under(fs) if not f.startswith("step_00000008/node_")
        ] == before  # no shard, no temporary
        assert location.read_pointer() == 4 and location.latest_complete().step == 4


def test_a_full_checkpoint_disk_stops_the_job_with_the_message_while_training_went_on(prepared_data, tmp_path, zygote):
    job = agent_job(tmp_path, prepared_data, steps=100_000, shm_dir=str(tmp_path / "shm"))
    with small_tmpfs(tmp_path / "fs", "128k") as fs:
        job = job.amended(
            checkpoint={"location": str(fs / "s")}, fault_tolerance={"saver_max_failures": 3, "saver_backoff_s": 0.05}
        )
        assert run_agent(job, zygote=zygote) == 1
        events = read_all(Path(job.job_dir) / EVENTS)
        failed = [e["error"] for e in events if e["event"] == "error"]
        assert (
            len(failed) == 1 and "CheckpointDiskFull: no space left on" in failed[0] and "checkpoint.keep" in failed[0]
        )
        assert cause_of(events, 1) == "disk_full" and "disk_full" in NON_RETRYABLE  # a human frees space first
        assert max(m["step"] for m in read_all(Path(job.job_dir) / METRICS)) > 2  # trained on past the failed persist
        assert ckpt.CheckpointStore.open(job.checkpoint.location).read_pointer() is None
        assert [f for f in files_under(fs) if ".tmp-" in f or f.endswith(".pt")] == []


def test_a_ledger_write_that_fills_the_disk_keeps_the_ledger_and_says_what_to_free(tmp_path):
    with small_tmpfs(tmp_path / "small", "1m") as fs:
        spec = small_spec(fs / "wd")
        ledger = Ledger.open(spec)
        ledger.begin_run("flow-1")
        before = (fs / "wd" / "ledger.json").read_bytes()
        filler = fs / "filler"
        with pytest.raises(OSError):  # fill the file system up to its last byte
            with open(filler, "wb") as f:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        with pytest.raises(LedgerDiskFull) as err:
            ledger.begin_run("flow-2")
        message = str(err.value)
        assert "no space left on" in message and str(fs) in message and "checkpoint.keep" in message
        assert (fs / "wd" / "ledger.json").read_bytes() == before  # the previous version, intact
        assert not [p for p in (fs / "wd").iterdir() if ".tmp-" in p.name]  # nothing torn left
        filler.unlink()  # the operator frees space: the same write now works
        ledger.begin_run("flow-2")
        assert Ledger.open(spec).record.invocations == 2
