"""The node's checkpoint saver: bounded restarts that fail the job with the saver's error, and
commit fencing (a saver of a superseded job writes nothing)."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from pretrain.run.incidents import cause_of
from support import s3_servers
from support.agents import agent_job, node_log, run_agent, snapshot, start_agent
from support.campaigns import wait_for
from support.s3_servers import BUCKET
from trainer.agent.node import SaverProcess
from trainer.checkpoint import fence
from trainer.checkpoint import store as ckpt
from trainer.checkpoint.saver import Saver
from trainer.checkpoint.store import stage_store
from trainer.job.reporting import EVENTS, JsonLines, read_all

seaweed_factory, aws_env = s3_servers.seaweed_factory, s3_servers.aws_env


def test_a_saver_that_keeps_failing_is_restarted_a_bounded_number_of_times_then_fails_the_job(prepared_data, tmp_path):
    job = agent_job(tmp_path, prepared_data, steps=100_000, shm_dir=str(tmp_path / "shm"))
    job = job.amended(fault_tolerance={"saver_max_failures": 3, "saver_backoff_s": 0.05})
    location = Path(job.checkpoint.location)
    location.mkdir(parents=True)
    for step in range(2, 2000, 2):  # a file where each step's directory should be: every persist fails
        (location / ckpt.step_name(step)).write_text("not a directory")
    assert run_agent(job) == 1
    events = read_all(Path(job.job_dir) / EVENTS)
    assert sum(e["event"] == "saver_start" for e in events) == 3
    failed = [e["error"] for e in events if e["event"] == "error" and e.get("source") == "agent"]
    assert len(failed) == 1 and "SaverFailed: checkpoint saver failed 3 times in a row" in failed[0]
    assert f"NotADirectoryError: [Errno 20] Not a directory: '{location}/step_" in failed[0]  # the saver's own error
    assert cause_of(events, 1) == "saver_failure"
    assert failed[0].removeprefix("SaverFailed: ") in node_log(job)
    assert (
        fence.holder(ckpt.CheckpointStore.open(job.checkpoint.location)) == job.job_dir
    )  # the agent claimed the location first
    assert not list((tmp_path / "shm").iterdir())


def test_a_saver_of_a_superseded_job_writes_nothing(tmp_path):
    location = ckpt.CheckpointStore.open(tmp_path / "ckpt")
    events = JsonLines(tmp_path / "events.jsonl")
    old = Saver(tmp_path / "shm", 1, location, keep=3, events=events, fence_owner="jobs/s/attempt_000")
    fence.claim(location, "jobs/s/attempt_000")
    snapshot(tmp_path / "shm", 4)
    assert old.persist(4) and location.read_pointer() == 4

    fence.claim(location, "jobs/s/attempt_001")  # the orchestrator started a newer job
    snapshot(tmp_path / "shm", 8)
    assert old.persist(8) is False
    assert location.read_pointer() == 4 and location.all_steps() == [4]  # nothing of step 8 written
    refused = [e for e in read_all(tmp_path / "events.jsonl") if e["event"] == "commit_refused"]
    assert refused and "attempt_001" in refused[0]["reason"] and old.stopping


def test_a_superseded_committer_writes_no_manifest_even_with_every_shard_in_place(tmp_path):
    """The fence moves while the committer waits for the other node's shards: it must not commit."""
    location = ckpt.CheckpointStore.open(tmp_path / "ckpt")
    committer = Saver(tmp_path / "node0", 1, location, keep=3, events=None, fence_owner="jobs/s/attempt_000")
    other = Saver(tmp_path / "node1", 1, location, keep=3, events=None, fence_owner="jobs/s/attempt_000")
    fence.claim(location, "jobs/s/attempt_000")
    snapshot(tmp_path / "node0", 6, rank=0, world=2)
    snapshot(tmp_path / "node1", 6, rank=1, world=2)
    assert committer.persist(6) and committer.pending == {6: 2}  # waiting for rank 1's shards
    fence.claim(location, "jobs/s/attempt_001")
    other.fence_owner = None  # (the other node's saver writes its shards regardless)
    assert other.persist(6)
    committer.commit_ready()
    assert location.manifest(6) is None and location.read_pointer() is None
    assert committer.pending == {}


def test_checkpoint_storage_away_for_a_while_does_not_fail_the_job(prepared_data, tmp_path, seaweed_factory, aws_env):
    """S3 down while a job trains: its saver fails more often than ``saver_max_failures`` allows,
    yet the job trains on (on memory snapshots) and persists again once S3 is back."""
    server = seaweed_factory()
    job = agent_job(
        tmp_path,
        prepared_data,
        steps=100_000,
        shm_dir=str(tmp_path / "shm"),
        uri=f"s3://{BUCKET}/away/{uuid.uuid4().hex[:8]}",
        s3_endpoint_url=server.endpoint,
    )
    job = job.amended(
        fault_tolerance={"saver_max_failures": 2, "saver_backoff_s": 0.05}, checkpoint={"s3_max_attempts": 1}
    )  # each try fails at once
    events = Path(job.job_dir) / EVENTS
    agent = start_agent(job, start_new_session=True)
    try:
        store = stage_store(job)
        wait_for(lambda: store.read_pointer() or agent.poll() is not None, 180, "a first committed checkpoint")
        first = store.read_pointer()
        server.stop()
        wait_for(
            lambda: sum(e["event"] == "saver_start" for e in read_all(events)) > 3 or agent.poll() is not None,
            180,
            "the saver to fail more often than saver_max_failures while S3 is down",
        )
        assert agent.poll() is None, node_log(job)  # not failed: the job trains on
        assert "checkpoint storage unreachable" in node_log(job) and "training goes on" in node_log(job)
        server.start()
        wait_for(
            lambda: (store.read_pointer() or 0) > first or agent.poll() is not None,
            180,
            "a checkpoint persisted once S3 is back",
        )
        assert agent.poll() is None and store.read_pointer() > first, node_log(job)
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()


@pytest.mark.parametrize(
    "failures, max_failures, outage_s, gives_up_at, says",
    [
        (["StorageUnreachable"] * 20, 2, 600.0, None, None),  # S3 away a while: never counted as failures in a row
        (["StorageUnreachable"], 2, 0.0, 1, "checkpoint storage unreachable for"),  # ... until it stays away too long
        (["NotADirectoryError"] * 3, 2, 600.0, 2, "checkpoint saver failed 2 times in a row"),
        (["NotADirectoryError", "StorageUnreachable", "NotADirectoryError"], 2, 600.0, 3, "failed 2 times in a row"),
        ([None, None], 2, 600.0, 2, "failed 2 times in a row"),  # killed without an error file
    ],
)
def test_the_saver_watch_counts_refusals_and_gives_an_unreachable_storage_time(
    failures, max_failures, outage_s, gives_up_at, says
):
    watch = SimpleNamespace(max_failures=max_failures, outage_s=outage_s, refusals=0, away_since=None, failed=None)
    at = next((i for i, kind in enumerate(failures, 1) if SaverProcess._gives_up(watch, "the error", kind)), None)
    assert at == gives_up_at  # the watch stops at its first give-up, as the agent's does
    assert (says is None) == (watch.failed is None) and (says is None or says in watch.failed)
