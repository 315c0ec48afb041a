"""Flash checkpoints: shared-memory snapshots, the saver process, restore from memory."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from pretrain.cluster.ports import free_port
from support.campaigns import wait_for
from support.jobs import CPU0, assert_same, tiny_job, trained
from trainer.agent.single_node import AgentSettings, NodeAgent
from trainer.checkpoint import state
from trainer.checkpoint import store as ckpt
from trainer.checkpoint.flash import SnapshotStore, copies_in_flight
from trainer.checkpoint.saver import BREAKPOINT_DELAY_S
from trainer.checkpoint.shm import ShmTooSmall, Slot
from trainer.job.config import JobConfig
from trainer.job.reporting import JsonLines, read_all
from trainer.loop import build_model, checkpoint, open_snapshots, snapshot_capacity


def job(tmp_path, **kw) -> JobConfig:
    return tiny_job(tmp_path, **kw)


def test_snapshot_round_trip_is_bit_exact(tmp_path):
    cfg = job(tmp_path)
    model, opt = trained(cfg)
    st = state.training_state(cfg, CPU0, step=7, consumed=14, model=model, optimizer=opt)
    st["extra"] = {"bf16": torch.randn(3, 5).bfloat16(), "empty": torch.empty(0, 4), "pair": (1, 2.5), 3: None}
    store = SnapshotStore(tmp_path / "shm", 0, 0, 1, capacity=1 << 20)
    assert store.snapshot(7, st, persist=False) is not None
    assert store.sealed_steps() == {7: 0} and store.verify(7)
    assert_same(store.load(7), st)


def test_a_snapshots_blocking_time_counts_gathering_the_state_not_only_the_copy(tmp_path, monkeypatch):
    """Training waits while the state dict is gathered (model, optimizer, RNG) as well as while it
    is copied: the time a checkpoint reports (goodput's checkpoint blocking) holds both."""
    cfg = job(tmp_path).amended(checkpoint={"memory_interval": 2, "interval": 10})
    model, opt = trained(cfg)
    spent = {"gather": 0.0, "copy": 0.0}
    gather, copy = state.training_state, SnapshotStore.snapshot

    def timed_gather(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return gather(*args, **kwargs)
        finally:
            spent["gather"] += time.perf_counter() - t0

    def timed_copy(self, *args, **kwargs):
        blocked = copy(self, *args, **kwargs)
        spent["copy"] += blocked
        return blocked

    monkeypatch.setattr(state, "training_state", timed_gather)
    monkeypatch.setattr(SnapshotStore, "snapshot", timed_copy)
    store = SnapshotStore(tmp_path / "shm", 0, 0, 1, capacity=1 << 20)
    events = JsonLines(tmp_path / "events.jsonl")
    assert checkpoint(cfg, CPU0, store, events, step=3, consumed=3, model=model, optimizer=opt) is None  # none due
    blocked = checkpoint(cfg, CPU0, store, events, step=4, consumed=4, model=model, optimizer=opt)
    assert spent["gather"] > 0 and spent["copy"] > 0 and blocked >= spent["gather"] + spent["copy"]
    store.flush()


@pytest.mark.parametrize(
    "flags, held, persist, expected",
    [
        # steps 5 (slot 0) and 10 (slot 1) taken with ``flags`` (persist?); ``held``: slots a reader holds
        ((False, False), {0}, False, {5: 0, 15: 1}),  # the saver persists 5: 15 replaces 10, 5 stays whole
        ((False, False), {0}, True, {5: 0, 15: 1}),
        ((False, True), {0}, False, {5: 0, 10: 1}),  # 10 is for the saver to persist: 15 is skipped
        ((False, True), {0}, True, {5: 0, 15: 1}),  # a newer step to persist replaces it
        ((False, False), {0, 1}, False, {5: 0, 10: 1}),  # both read: skipped, neither torn
        ((False, False), {1}, False, {15: 0, 10: 1}),  # the older one free: taken, as always
    ],
    ids=["older-held", "older-held-persist", "newest-pending", "newest-pending-newer", "both-held", "newest-held"],
)
def test_a_snapshot_goes_where_it_tears_nothing_and_takes_nothing_from_the_saver(
    tmp_path, flags, held, persist, expected
):
    """While a reader (the saver persisting, a peer restoring) holds the older slot, the next
    snapshot replaces the newest one instead of being skipped, so memory snapshots stay fresh
    through a slow persist; one complete snapshot (the held one) remains throughout."""
    store = SnapshotStore(tmp_path / "shm", 0, 0, 1, capacity=1 << 16)
    for step, flag in zip((5, 10), flags):
        store.snapshot(step, {"w": torch.full((8,), float(step))}, persist=flag)
    assert store.sealed_steps() == {5: 0, 10: 1}
    with contextlib.ExitStack() as readers:
        for i in held:
            readers.enter_context(store.slots[i].lock(exclusive=False))
        taken = store.snapshot(15, {"w": torch.full((8,), 15.0)}, persist=persist)
    assert (taken is None) == (15 not in expected)
    assert store.sealed_steps() == expected
    assert all(store.verify(step) and store.load(step)["w"][0] == step for step in expected)


def test_flush_waits_for_every_snapshot_still_sealing_not_only_the_last(tmp_path, monkeypatch):
    """Two snapshots close together: the first one's digest may still be computing when the
    second is taken (the suite caught it on a loaded machine: step 5 not yet sealed). The first
    seal is held here until flush has started waiting."""
    release, seal = threading.Event(), SnapshotStore._seal

    def slow_first(slot, step):
        if step == 5:
            release.wait(30)
        seal(slot, step)

    monkeypatch.setattr(SnapshotStore, "_seal", staticmethod(slow_first))
    store = SnapshotStore(tmp_path / "shm", 0, 0, 1, capacity=1 << 16)
    for step in (5, 10):
        store.snapshot(step, {"w": torch.full((8,), float(step))}, persist=False)
    threading.Timer(0.2, release.set).start()  # after flush (in sealed_steps) has begun to wait
    assert store.sealed_steps() == {5: 0, 10: 1}


@pytest.mark.parametrize(
    "header, live, busy",
    [
        ({"state": "writing"}, True, True),  # being copied
        ({"state": "ready"}, True, True),  # copied, its digest still being computed
        ({"state": "ready", "digest": "ab"}, True, False),  # sealed
        ({"state": "writing"}, False, False),  # torn by a process that is gone: nothing to wait for
        (None, True, False),  # never written
    ],
    ids=["copying", "sealing", "sealed", "torn-by-the-dead", "empty"],
)
def test_copies_in_flight_are_the_live_workers_unsealed_snapshots(tmp_path, header, live, busy):
    slot = Slot(tmp_path / "rank000.slot0", 1 << 12)
    if header is not None:
        slot.set_header({**header, "step": 4, "pid": os.getpid() if live else -1})
    slot.close()
    assert copies_in_flight(tmp_path, {os.getpid()}) == (["rank000.slot0"] if busy else [])


# A worker copying a snapshot into its slot (0.5 s), then sealing it; on SIGTERM it reports
# whether the slot was sealed when the signal came.
COPYING_WORKER = textwrap.dedent("""
    import os, signal, sys, time
    from trainer.checkpoint.shm import Slot
    slot = Slot(sys.argv[1], 1 << 12)
    def stopped(signum, frame):
        h = slot.header()
        open(sys.argv[2], "w").write("sealed" if h.get("digest") else h["state"])
        os._exit(143)
    signal.signal(signal.SIGTERM, stopped)
    slot.set_header({"state": "writing", "step": 4, "pid": os.getpid()})
    time.sleep(0.5)  # the copy
    slot.set_header({"state": "ready", "step": 4, "pid": os.getpid()})
    slot.set_header({"state": "ready", "step": 4, "pid": os.getpid(), "digest": "ab"})
    signal.pause()
""")


def test_a_full_restart_lets_a_survivor_finish_the_snapshot_it_is_copying(tmp_path):
    """Stopped mid-copy, the survivor would lack the newest snapshot its lost peer holds, and the
    restart would go back to the snapshot before."""
    ns, report = tmp_path / "shm", tmp_path / "at_sigterm"
    ns.mkdir()
    survivor = subprocess.Popen([sys.executable, "-c", COPYING_WORKER, str(ns / "rank000.slot0"), str(report)])
    settings = AgentSettings(
        nproc=1,
        max_restarts=1,
        threads=1,
        node=0,
        port=free_port(),
        spares=0,
        fast=False,
        fast_timeout_s=0,
        shm=str(ns),
    )
    restarted = []
    agent = NodeAgent(settings, lambda extra, env: restarted.append(env) or subprocess.Popen(["sleep", "60"]))
    agent.workers = {0: survivor}
    try:
        wait_for(lambda: copies_in_flight(ns, {survivor.pid}), 30, "the survivor's copy")
        agent.full_restart()
        assert report.read_text() == "sealed" and survivor.returncode == 143
        assert [env["TORCHELASTIC_RESTART_COUNT"] for env in restarted] == ["1"]
    finally:
        agent.close()


def test_restore_prefers_memory_and_falls_back_to_storage_when_memory_is_corrupt(tmp_path):
    cfg = job(tmp_path)
    model, opt = trained(cfg)
    state.save(cfg, CPU0, step=10, consumed=20, model=model, optimizer=opt)
    trained_more, opt_more = trained(cfg, steps=3)
    store = SnapshotStore(tmp_path / "shm", 0, 0, 1, capacity=snapshot_capacity(cfg, 0))
    store.snapshot(
        15, state.training_state(cfg, CPU0, step=15, consumed=30, model=trained_more, optimizer=opt_more), persist=False
    )
    fresh, fresh_opt = build_model(cfg, torch.device("cpu"))
    got = state.restore(cfg, CPU0, model=fresh, optimizer=fresh_opt, snapshots=store)
    assert (got.source, got.step, got.consumed) == ("memory", 15, 30)
    assert_same(fresh.state_dict(), trained_more.state_dict())
    assert_same(fresh_opt.state_dict()["state"], opt_more.state_dict()["state"])

    h = store.slots[0].header()
    store.slots[0].mm[h["data_off"] + 100] ^= 0xFF  # one flipped byte in shared memory
    assert not store.verify(15)
    fresh, fresh_opt = build_model(cfg, torch.device("cpu"))
    got = state.restore(cfg, CPU0, model=fresh, optimizer=fresh_opt, snapshots=store)
    assert (got.source, got.step, got.consumed) == ("checkpoint", 10, 20)
    assert_same(fresh.state_dict(), model.state_dict())


def test_a_rank_reads_rank_0s_verified_snapshot_from_the_nodes_shared_memory(tmp_path):
    """In a job of one node every rank reads rank 0's replicated state from its slot instead of
    having it sent over the group: only a sealed snapshot of that step, rank and world whose
    bytes match their digest."""
    rank0 = SnapshotStore(tmp_path / "shm", 0, 0, 2, capacity=1 << 16)
    rank1 = SnapshotStore(tmp_path / "shm", 1, 1, 2, capacity=1 << 16)
    shared = {"shared": {"w": torch.arange(8.0), "step": 4}}
    rank0.snapshot(4, shared, persist=False)
    rank0.flush()
    assert_same(rank1.load_local(0, 0, 4), shared)
    assert rank1.load_local(0, 0, 6) is None  # no snapshot of that step
    assert rank1.load_local(0, 1, 4) is None  # that slot is rank 0's, not rank 1's
    assert SnapshotStore(tmp_path / "shm", 1, 1, 3, capacity=1 << 16).load_local(0, 0, 4) is None  # another world
    h = rank0.slots[0].header()
    rank0.slots[0].mm[h["data_off"] + 3] ^= 0xFF
    assert rank1.load_local(0, 0, 4) is None  # its bytes no longer match the digest


def test_a_world_that_changed_size_restores_the_last_worlds_rank_0_snapshot_from_memory(tmp_path):
    """A node lost without a standby: the survivor's rank of the smaller world holds no snapshot of
    its own world, but the last world's rank 0 left the replicated state and the global data
    position in this node's shared memory. Restored from there (newer than the checkpoint), unless
    it is older than the checkpoint or its bytes no longer match their digest."""
    cfg = job(tmp_path)
    model, opt = trained(cfg)
    state.save(cfg, CPU0, step=10, consumed=20, model=model, optimizer=opt)
    later, later_opt = trained(cfg, steps=3)
    old_rank0 = dataclasses.replace(CPU0, world_size=2)
    last_world = SnapshotStore(tmp_path / "shm", 0, 0, 2, capacity=snapshot_capacity(cfg, 0))
    last_world.snapshot(
        14, state.training_state(cfg, old_rank0, step=14, consumed=28, model=later, optimizer=later_opt), persist=False
    )
    last_world.flush()
    now = SnapshotStore(tmp_path / "shm", 0, 0, 1, capacity=snapshot_capacity(cfg, 0))  # world 1 on the same node
    assert now.sealed_steps() == {} and list(now.replicated_elsewhere()) == [14]
    fresh, fresh_opt = build_model(cfg, torch.device("cpu"))
    got = state.restore(cfg, CPU0, model=fresh, optimizer=fresh_opt, snapshots=now)
    assert (got.source, got.step, got.consumed) == ("memory", 14, 28)
    assert_same(fresh.state_dict(), later.state_dict())
    assert_same(fresh_opt.state_dict()["state"], later_opt.state_dict()["state"])

    state.save(cfg, CPU0, step=16, consumed=32, model=model, optimizer=opt)  # a newer checkpoint wins
    fresh, fresh_opt = build_model(cfg, torch.device("cpu"))
    assert state.restore(cfg, CPU0, model=fresh, optimizer=fresh_opt, snapshots=now).source == "checkpoint"

    h = last_world.slots[0].header()
    last_world.slots[0].mm[h["data_off"] + 5] ^= 0xFF  # damaged in shared memory
    assert now.load_replicated(14) is None


@pytest.mark.parametrize(
    "fields, live, kept",
    [
        ({}, (7, 14), ("survivors", 7, 14)),  # DDP: the survivors go on from the step they hold
        ({"model.dropout": 0.1}, (7, 14), None),  # each rank's RNG shapes training: roll back
        ({"cluster.parallelism": "fsdp"}, (7, 14), None),  # each rank holds its own pieces: roll back
        ({}, None, None),  # nobody holds live state
    ],
)
def test_state_kept_by_survivors_only_when_it_is_replicated(tmp_path, fields, live, kept):
    cfg = job(tmp_path)
    for name, value in fields.items():
        section, field = name.split(".")
        cfg = cfg.amended(**{section: {field: value}})
    model, opt = build_model(job(tmp_path), torch.device("cpu"))
    got = state.kept_by_survivors(cfg, CPU0, live, model=model, optimizer=opt)
    assert (None if got is None else (got.source, got.step, got.consumed)) == kept


def test_too_little_shared_memory_is_a_clear_error_or_falls_back(tmp_path):
    cfg = job(tmp_path)
    events = JsonLines(tmp_path / "job" / "events.jsonl")
    huge = 1 << 50
    with pytest.raises(ShmTooSmall, match=r"MiB free but the checkpoint snapshots need .*shm_fallback: true"):
        open_snapshots(cfg, CPU0, huge, str(tmp_path / "shm"), events)
    fallback = job(tmp_path, checkpoint={"shm_fallback": True})
    assert open_snapshots(fallback, CPU0, huge, str(tmp_path / "shm"), events) is None
    assert read_all(tmp_path / "job" / "events.jsonl")[-1]["event"] == "shm_fallback"


def start_saver(tmp_path, ns, nproc=1):
    job_file = tmp_path / "saver-job.json"
    job_file.write_text(job(tmp_path, checkpoint={"keep": 3}).to_json())
    return subprocess.Popen(
        [sys.executable, "-m", "trainer.saver", "--ns", str(ns), "--nproc", str(nproc), "--job", str(job_file)]
    )


def test_saver_persists_only_flagged_snapshots_bit_exact(tmp_path):
    cfg = job(tmp_path)
    model, opt = trained(cfg)
    ns = tmp_path / "shm"
    store = SnapshotStore(ns, 0, 0, 1, capacity=snapshot_capacity(cfg, 0))
    store.snapshot(5, state.training_state(cfg, CPU0, step=5, consumed=10, model=model, optimizer=opt), persist=False)
    st = state.training_state(cfg, CPU0, step=10, consumed=20, model=model, optimizer=opt)
    store.snapshot(10, st, persist=True)
    saver = start_saver(tmp_path, ns)
    try:
        wait_for(
            lambda: ckpt.CheckpointStore.open(cfg.checkpoint.location).read_pointer() == 10,
            60,
            "the saver to commit step 10",
        )
    finally:
        saver.terminate()
        saver.wait(30)
    assert ckpt.CheckpointStore.open(cfg.checkpoint.location).committed_steps() == [10]
    saved = ckpt.CheckpointStore.open(cfg.checkpoint.location)
    step = saved.latest_complete().step
    assert_same(saved.load_shard(step, state.MODEL_SHARD), st["shared"])
    assert_same(saved.load_shard(step, ckpt.rank_shard_name(0)), st["rank"])


def test_saver_killed_mid_persist_never_commits_a_torn_checkpoint(tmp_path):
    ns = tmp_path / "shm"
    store = SnapshotStore(ns, 0, 0, 1, capacity=300 << 20)
    big = {"shared": {"model": {"w": torch.randn(64 << 20)}, "step": 8}, "rank": {"consumed": 16, "step": 8}}
    store.snapshot(8, big, persist=True)
    store.flush()
    saver = start_saver(tmp_path, ns)
    step_dir = tmp_path / "ckpt" / ckpt.step_name(8)
    wait_for(step_dir.exists, 60, "the saver to start persisting")
    saver.send_signal(signal.SIGKILL)
    saver.wait()
    assert not (step_dir / ckpt.MANIFEST).exists(), "the kill came too late to be mid-persist"
    assert ckpt.CheckpointStore.open(tmp_path / "ckpt").latest_complete() is None
    saver = start_saver(tmp_path, ns)  # what the node agent does when its saver dies
    try:
        wait_for(
            lambda: ckpt.CheckpointStore.open(tmp_path / "ckpt").read_pointer() == 8,
            120,
            "the restarted saver to commit step 8",
        )
    finally:
        saver.terminate()
        saver.wait(30)
    saved = ckpt.CheckpointStore.open(tmp_path / "ckpt")
    assert saved.latest_complete().step == 8
    assert torch.equal(saved.load_shard(8, "model.pt")["model"]["w"], big["shared"]["model"]["w"])


def test_saver_saves_at_breakpoint_when_a_worker_dies(tmp_path):
    """A worker process snapshots step 12 (not due for persisting) and is SIGKILLed: the saver
    persists the newest consistent snapshot anyway, so the work is not lost — once the recovery
    had the CPU for ``BREAKPOINT_DELAY_S``."""
    ns = tmp_path / "shm"
    script = textwrap.dedent(f"""
        import sys, torch
        from trainer.checkpoint.flash import SnapshotStore
        store = SnapshotStore({str(ns)!r}, 0, 0, 1, capacity=1 << 20)
        for step in (6, 12):
            store.snapshot(step, {{"shared": {{"w": torch.full((4,), float(step)), "step": step}},
                                   "rank": {{"consumed": step, "step": step}}}}, persist=step == 6)
        store.flush()
        print("snapshotted", flush=True)
        sys.stdin.read()
    """)
    worker = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert worker.stdout.readline().strip() == "snapshotted"
    saver = start_saver(tmp_path, ns)
    try:
        wait_for(lambda: ckpt.CheckpointStore.open(tmp_path / "ckpt").read_pointer() == 6, 60, "the flagged step 6")
        killed_at = time.time()
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        wait_for(
            lambda: ckpt.CheckpointStore.open(tmp_path / "ckpt").read_pointer() == 12,
            60,
            "the breakpoint save of step 12",
        )
    finally:
        saver.terminate()
        saver.wait(30)
    [save] = [e for e in read_all(tmp_path / "job" / "events.jsonl") if e["event"] == "breakpoint_save"]
    assert save["step"] == 12 and save["time"] >= killed_at + BREAKPOINT_DELAY_S
    saved = ckpt.CheckpointStore.open(tmp_path / "ckpt")
    assert torch.equal(saved.load_shard(saved.latest_complete().step, "model.pt")["w"], torch.full((4,), 12.0))
