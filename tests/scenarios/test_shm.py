"""Shared memory: leaked snapshot directories are swept, the capacity check covers the whole
node, a full shared-memory file system is the clear ShmTooSmall (or the fallback), and a slot
reads back every snapshot written into it."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch

from support.agents import agent_job, node_log, start_agent
from support.campaigns import wait_for
from support.jobs import CPU0, assert_same, tiny_job, trained
from support.tmpfs import small_tmpfs
from trainer.checkpoint import shmdirs, state
from trainer.checkpoint.flash import SnapshotStore
from trainer.checkpoint.shm import ShmTooSmall, Slot, slot_paths
from trainer.dist import DistInfo
from trainer.job.config import JobConfig
from trainer.job.reporting import EVENTS, JsonLines, read_all
from trainer.loop import open_snapshots, snapshot_capacity


def test_a_sigkilled_agent_leaves_its_snapshot_dir_and_the_next_agent_sweeps_it(prepared_data, tmp_path):
    shm = tmp_path / "shm"
    killed = agent_job(tmp_path / "a", prepared_data, steps=100_000, shm_dir=str(shm))
    agent = start_agent(killed)
    owned = wait_for(
        lambda: [p for p in shm.glob("pretrain-*") if (p / shmdirs.OWNER_FILE).exists()],
        60,
        "the agent's snapshot directory",
    )
    wait_for(lambda: any(p.name.startswith("rank") for p in owned[0].iterdir()), 120, "the worker's snapshot slots")
    children = psutil.Process(agent.pid).children(recursive=True)
    agent.send_signal(signal.SIGKILL)  # what the OOM killer does
    agent.wait()
    wait_for(
        lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children),
        60,
        "the dead agent's workers and saver to exit",
    )
    assert owned[0].is_dir() and any(owned[0].iterdir()), "the killed agent's directory is left behind"

    live = shmdirs.create(shm, "/another/campaign/job")  # a live owner (this test process): never swept
    nxt = agent_job(tmp_path / "b", prepared_data, steps=2, shm_dir=str(shm))
    assert start_agent(nxt).wait(180) == 0, node_log(nxt)
    assert not owned[0].exists()
    assert live.is_dir()
    assert sorted(p.name for p in shm.iterdir()) == [live.name]  # the new agent cleaned up its own too
    swept = [e for e in read_all(os.path.join(nxt.job_dir, EVENTS)) if e["event"] == "shm_swept"]
    assert swept and swept[0]["dirs"] == [str(owned[0])] and swept[0]["bytes"] > 0
    assert "freed" in node_log(nxt)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def owned_dir(root, name, owner: dict | None, slot: bool = True):
    d = root / name
    d.mkdir()
    if owner is not None:
        (d / shmdirs.OWNER_FILE).write_text(json.dumps(owner))
    if slot:
        (d / "rank000.slot0").write_bytes(b"\0" * 4096)
    return d


@pytest.mark.parametrize(
    "case, swept",
    [
        ("owner dead", True),
        ("owner alive", False),
        ("pid recycled: alive, started at another time", True),
        ("owner in another pid namespace", False),
        ("no owner record, pid in the name dead", True),
        ("no owner record, pid in the name alive", False),
        ("damaged owner record, pid in the name dead", True),
        ("not a snapshot directory", False),
        ("owner dead but a slot still locked", False),
    ],
)
def test_sweep_removes_only_directories_whose_owner_is_dead(tmp_path, case, swept):
    me, gone = shmdirs.owner_record(), dead_pid()
    dead = {**me, "pid": gone, "start": None}
    name = f"pretrain-{gone}-0123456789"
    owner = {
        "owner dead": dead,
        "owner alive": me,
        "pid recycled: alive, started at another time": {**me, "start": me["start"] - 1},
        "owner in another pid namespace": {**dead, "pid_ns": "pid:[1]"},
        "no owner record, pid in the name dead": None,
        "no owner record, pid in the name alive": None,
        "not a snapshot directory": dead,
        "owner dead but a slot still locked": dead,
    }.get(case)
    if case in (
        "owner alive",
        "pid recycled: alive, started at another time",
        "no owner record, pid in the name alive",
    ):
        name = f"pretrain-{os.getpid()}-0123456789"
    if case == "not a snapshot directory":
        name = "pretrain-move-abc"
    d = owned_dir(tmp_path, name, owner)
    if case == "damaged owner record, pid in the name dead":
        (d / shmdirs.OWNER_FILE).write_text('{"pid": ')
    held = None
    if case == "owner dead but a slot still locked":  # e.g. the dead agent's saver still persisting
        held = os.open(d / "rank000.slot0", os.O_RDONLY)
        fcntl.flock(held, fcntl.LOCK_SH)
    try:
        result = shmdirs.sweep_orphans(tmp_path)
    finally:
        if held is not None:
            os.close(held)
    assert (not d.exists()) == swept
    assert [p for p, _ in result] == ([d] if swept else [])


def test_agents_sweeping_the_same_orphans_at_once_never_fail(tmp_path):
    """The node agents of a local cluster start together and sweep the same /dev/shm: one found a
    directory another had just deleted and failed at start-up (a lost node, a resize)."""
    gone = dead_pid()
    for round_ in range(20):
        dirs = [
            owned_dir(
                tmp_path, f"pretrain-{gone}-{round_:04d}{i:06d}", {**shmdirs.owner_record(), "pid": gone, "start": None}
            )
            for i in range(20)
        ]
        for d in dirs:
            for j in range(1, 8):
                (d / f"rank{j:03d}.slot0").write_bytes(b"\0" * 512)
        with ThreadPoolExecutor(4) as pool:
            found = [p for result in pool.map(shmdirs.sweep_orphans, [tmp_path] * 4) for p, _ in result]
        assert not [d for d in dirs if d.exists()]
        assert set(found) <= set(dirs)


CPU = torch.device("cpu")


def ddp_job(tmp_path, **kw) -> JobConfig:
    return tiny_job(tmp_path, parallelism="fsdp", **kw)


@pytest.mark.parametrize("local_ranks, fits", [(1, True), (2, True), (4, False)])
def test_capacity_check_counts_every_local_rank_of_the_node(tmp_path, monkeypatch, local_ranks, fits):
    """Each FSDP rank's two slots take ~1.1 MiB here: one or two ranks fit in 6 MiB, four do not
    — and the first rank to check must say so, before any rank allocates."""
    cfg = ddp_job(tmp_path)
    events = JsonLines(tmp_path / "job" / EVENTS)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    info = DistInfo(rank=0, local_rank=0, world_size=local_ranks, restart_count=0, device=CPU, backend="gloo")
    with small_tmpfs(tmp_path / "shm", "6m") as shm:
        ns = shm / "pretrain-1-0123456789"
        capacity = snapshot_capacity(cfg, 0, local_ranks)
        if fits:
            assert open_snapshots(cfg, info, capacity, str(ns), events) is not None
            return
        with pytest.raises(ShmTooSmall, match=rf"each of the node's {local_ranks} local rank\(s\).*shm_fallback: true"):
            open_snapshots(cfg, info, capacity, str(ns), events)
        assert not any(ns.iterdir())  # nothing allocated
        fallback = ddp_job(tmp_path, checkpoint={"shm_fallback": True})
        assert open_snapshots(fallback, info, capacity, str(ns), events) is None
        assert read_all(tmp_path / "job" / EVENTS)[-1]["event"] == "shm_fallback"


def test_enospc_while_allocating_a_slot_is_shm_too_small_or_the_fallback(tmp_path):
    events = JsonLines(tmp_path / "job" / EVENTS)
    info = DistInfo(rank=0, local_rank=0, world_size=1, restart_count=0, device=CPU, backend="gloo")
    with small_tmpfs(tmp_path / "shm", "4m") as shm:
        with pytest.raises(ShmTooSmall, match=r"snapshot slot rank000.slot0.*shm_fallback: true"):
            Slot(shm / "rank000.slot0", 8 << 20)
        assert (shm / "rank000.slot0").stat().st_size == 0  # a partial allocation is given back
        # slot files that look big enough (sparse) pass the check; allocating them hits ENOSPC
        ns = shm / "ns"
        ns.mkdir()
        for p in slot_paths(ns, 0):
            with open(p, "wb") as f:
                f.truncate((3 << 20) - 1)
        with pytest.raises(ShmTooSmall):
            SnapshotStore(ns, 0, 0, 1, capacity=3 << 20)
        fallback = ddp_job(tmp_path, checkpoint={"shm_fallback": True})
        assert open_snapshots(fallback, info, 3 << 20, str(ns), events) is None
        assert read_all(tmp_path / "job" / EVENTS)[-1]["event"] == "shm_fallback"


def test_every_snapshot_into_a_slot_reads_back_exactly_as_its_layout_stays_or_changes(tmp_path):
    """A slot copies a state laid out as its last one into the views it made then: each later
    snapshot must still read back bit-exact, whether only the values changed, the layout record
    grew past a page (the data moves), the state grew (the slot is remapped) or shrank again."""
    cfg = tiny_job(tmp_path)
    slot = Slot(tmp_path / "slot", capacity=1 << 16)  # too small for the state: the first write grows it
    firsts = set()
    for step, change in enumerate(["first", "values", "long record", "larger state", "values", "smaller again"]):
        model, opt = trained(cfg, steps=2 + step)  # new values every time
        st = state.training_state(cfg, CPU0, step=step, consumed=step, model=model, optimizer=opt)
        if change == "long record":
            st["note"] = "x" * 5000  # the layout record grows past a page: the data region starts later
        if change == "larger state":
            st["extra"] = torch.randn(1 << 16)
        slot.write(st, {"step": step})
        back = slot.read(slot.header())
        assert_same(back, st)
        firsts.add(next(iter(back["shared"]["model"].values())).flatten()[0].item())
    assert len(firsts) == 6  # every snapshot's values were new, so a stale copy could not pass
    slot.close()
