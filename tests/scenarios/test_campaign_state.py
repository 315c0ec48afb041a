"""Campaign state on shared storage (``checkpoint.state_uri``) on real S3 servers (SeaweedFS, moto):
the ledger written with conditional writes, the lease that keeps two orchestrators apart, and the
fencing of a job whose run lost the lease. Expiry is driven by a short TTL in the environment
(``PRETRAIN_LEASE_TTL_S``) and polled with a deadline, never slept out.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import pytest

from pretrain.settings import PretrainSettings
from pretrain.state.guard import LEASE_KEY, campaign_guard, check_holds, held, job_lease, state_storage
from pretrain.state.lease import Lease, LeaseLost
from pretrain.state.ledger import Ledger
from pretrain.state.lock import CampaignBusy
from support import s3_servers
from support.agents import snapshot
from support.campaigns import small_spec, wait_for
from support.s3_servers import BUCKET
from trainer.checkpoint import store as ckpt
from trainer.checkpoint.fence import LeaseFence, LeaseRecord
from trainer.checkpoint.saver import Saver
from trainer.job.reporting import JsonLines, read_all

seaweed, moto, aws_env = s3_servers.seaweed, s3_servers.moto, s3_servers.aws_env
REPO = Path(__file__).resolve().parents[2]


def s3_state_spec(tmp_path: Path, endpoint: str):
    """A small campaign whose state lives under a fresh S3 prefix (its checkpoints stay local)."""
    return small_spec(
        tmp_path / "wd",
        checkpoint={
            "interval": 4,
            "memory_interval": 2,
            "keep": 2,
            "state_uri": f"s3://{BUCKET}/state-{uuid.uuid4().hex[:10]}",
            "s3_endpoint_url": endpoint,
            "s3_region": "us-east-1",
        },
    )


def test_ledger_writers_racing_on_s3_lose_no_update(tmp_path, seaweed, aws_env):
    """Three writers (each its own Ledger, as several flows hold one) add restarts at once: every
    increment lands, none is overwritten by a writer that read an older version. On SeaweedFS only:
    moto_server's conditional writes are not atomic under concurrent requests (see test_lease)."""
    spec = s3_state_spec(tmp_path, seaweed.endpoint)
    writers, each = 3, 4
    start = threading.Barrier(writers)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            ledger = Ledger.open(spec)
            start.wait()
            for _ in range(each):
                ledger.add_restarts("warmup", 1)
        except BaseException as err:  # noqa: BLE001 - reported by the assert below
            errors.append(err)

    threads = [threading.Thread(target=write) for _ in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert Ledger.open(spec).reload().stages["warmup"].restarts == writers * each
    assert not (spec.workdir_path / "ledger.json").exists()  # the state is on S3, not in the workdir
    assert state_storage(spec).list() == ["ledger.json"]


HOLDER = textwrap.dedent("""
    import sys
    from pretrain.state.guard import campaign_guard
    from pretrain.state.ledger import Ledger
    from pretrain.spec.campaign import CampaignSpec
    spec = CampaignSpec.model_validate_json(open(sys.argv[1]).read())
    with campaign_guard(spec, "run-A"):
        Ledger.open(spec).begin_run("run-A")
        print("holding", flush=True)
        sys.stdin.read()  # until the test kills it
""")


def test_a_second_orchestrator_is_refused_by_the_lease_and_takes_over_once_the_holder_died(tmp_path, moto, aws_env):
    spec = s3_state_spec(tmp_path, moto.endpoint)
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    # a TTL short enough to wait out, long enough for the taking run's writes to moto on a loaded
    # machine (2 s: the lease it had just taken expired before its first ledger write)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PRETRAIN_LEASE_TTL_S": "8", "PRETRAIN_LEASE_MARGIN_S": "0"}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "spec.json")],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "holding\n"
        quick = PretrainSettings(lease_ttl_s=8, lease_margin_s=0)
        with pytest.raises(CampaignBusy) as refused:
            with campaign_guard(spec, "run-B", settings=quick):
                pass
        message = str(refused.value)
        assert f"pid {holder.pid}, flow run run-A" in message and "generation 1" in message
        assert "wait for that run to finish or cancel it" in message
        assert Ledger.open(spec).record.flow_run == "run-A"  # the refused run wrote nothing

        holder.send_signal(signal.SIGKILL)  # the holder dies without releasing: its lease expires
        holder.wait(timeout=30)

        def take_over() -> bool:
            try:
                with campaign_guard(spec, "run-B", settings=quick):
                    ledger = Ledger.open(spec)
                    ledger.begin_run("run-B")
                    lease = job_lease(spec)
                    assert held(spec) is not None and lease.generation == 2
                return True
            except CampaignBusy:
                return False

        wait_for(take_over, timeout=60, what="the dead holder's lease to expire")
        record = Ledger.open(spec).record
        assert (record.flow_run, record.invocations) == ("run-B", 2)  # it carried on from what run A recorded
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_a_run_whose_lease_was_taken_over_writes_no_more_campaign_state(tmp_path, moto, aws_env):
    """Another run took the lease (here: a newer generation written over it, as a takeover after
    an expiry this run did not notice leaves it): the check before a `good` pointer and the
    ledger's next write both refuse, naming the new holder."""
    spec = s3_state_spec(tmp_path, moto.endpoint)
    # no expiry is waited for: a TTL that moto's answers on a loaded machine cannot outlast (3 s did:
    # the lease lapsed before the run's first ledger write); the keeper renews every TTL / 3
    with campaign_guard(spec, "run-A", settings=PretrainSettings(lease_ttl_s=15, lease_margin_s=0)):
        ledger = Ledger.open(spec)
        ledger.begin_run("run-A")
        check_holds(spec)  # still ours
        state_storage(spec).put_bytes(
            LEASE_KEY,
            LeaseRecord(holder="run B on host-b", generation=2, token="b", expires_at=4e9, ttl_s=60).to_bytes(),
        )
        with pytest.raises(LeaseLost, match="held by run B on host-b"):
            check_holds(spec)
        wait_for(lambda: held(spec).lost, timeout=30, what="the keeper to find the lease lost")
        with pytest.raises(LeaseLost, match="held by run B on host-b"):
            ledger.set_status(ledger.record.status)
    assert Ledger.open(spec).record.invocations == 1


def test_a_job_whose_lease_was_taken_over_cannot_commit(tmp_path, moto, aws_env):
    """A saver commits under its job's lease generation; once another run took the lease over,
    its next checkpoint is neither written nor pointed to, and its event says it was fenced."""
    spec = s3_state_spec(tmp_path, moto.endpoint)
    storage = state_storage(spec)
    clock = [1_000_000.0]
    first = Lease.acquire(storage, LEASE_KEY, "run A", ttl_s=30, margin_s=5, clock=lambda: clock[0])
    location = ckpt.CheckpointStore.open(tmp_path / "ckpt")
    fence = LeaseFence(
        spec.checkpoint.state_uri, LEASE_KEY, first.generation, {"endpoint_url": moto.endpoint, "region": "us-east-1"}
    )
    saver = Saver(tmp_path / "shm", 1, location, keep=3, events=JsonLines(tmp_path / "events.jsonl"), lease=fence)
    snapshot(tmp_path / "shm", 4)
    assert saver.persist(4) and location.read_pointer() == 4

    clock[0] += 60  # run A stopped renewing; run B takes the campaign over
    second = Lease.acquire(storage, LEASE_KEY, "run B", ttl_s=30, margin_s=5, clock=lambda: clock[0])
    assert second.generation == 2
    snapshot(tmp_path / "shm", 8)
    assert saver.persist(8) is False and saver.superseded
    assert location.read_pointer() == 4 and location.all_steps() == [4]  # nothing of step 8 written
    refused = [e for e in read_all(tmp_path / "events.jsonl") if e["event"] == "commit_refused"]
    assert (
        len(refused) == 1 and "fenced" in refused[0]["reason"] and "generation 2, held by run B" in refused[0]["reason"]
    )


def test_a_lease_that_cannot_be_read_holds_the_commit_back_without_giving_up(tmp_path):
    """Storage of the lease away (here: no lease object where the job was told): the saver writes
    nothing now, says why once, and is not superseded (the next poll tries again)."""
    location = ckpt.CheckpointStore.open(tmp_path / "ckpt")
    fence = LeaseFence(str(tmp_path / "state"), LEASE_KEY, 1)
    saver = Saver(tmp_path / "shm", 1, location, keep=3, events=JsonLines(tmp_path / "events.jsonl"), lease=fence)
    snapshot(tmp_path / "shm", 4)
    assert saver.persist(4) is False and saver.persist(4) is False
    assert not saver.superseded and not saver.stopping and location.read_pointer() is None
    deferred = [e for e in read_all(tmp_path / "events.jsonl") if e["event"] == "commit_deferred"]
    assert len(deferred) == 1 and LEASE_KEY in deferred[0]["reason"]


def test_a_local_campaign_keeps_its_ledger_and_flock_in_the_workdir(tmp_path):
    spec = small_spec(tmp_path / "wd")
    with campaign_guard(spec, "run-A"):
        Ledger.open(spec).begin_run("run-A")
        assert job_lease(spec) is None and held(spec) is None
        other = subprocess.run(
            [
                sys.executable,
                "-c",
                "from pretrain.state.lock import campaign_lock\n"
                f"with campaign_lock({str(spec.workdir_path)!r}, 't'): pass",
            ],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
        )
        assert other.returncode != 0 and "is already running" in other.stderr
    assert (spec.workdir_path / "ledger.json").exists() and (spec.workdir_path / "campaign.lock").exists()


@pytest.mark.parametrize(
    "checkpoint, problem",
    [
        (
            {"state_uri": "s3://b/state", "s3_endpoint_url": "http://127.0.0.1:9000"},
            None,
        ),  # local checkpoints, state on S3
        ({"state_uri": "/shared/volume/state"}, None),
        ({"s3_endpoint_url": "http://127.0.0.1:9000"}, "only apply when uri or state_uri is an s3:// URL"),
        ({"state_uri": "s3://KEY:SECRET@b/state"}, "credentials"),
    ],
)
def test_state_uri_in_the_spec(tmp_path, checkpoint, problem):
    from pretrain.spec.campaign import SpecError

    if problem is None:
        assert small_spec(tmp_path, checkpoint=checkpoint).checkpoint.state_uri == checkpoint["state_uri"]
    else:
        with pytest.raises(SpecError, match=problem):
            small_spec(tmp_path, checkpoint=checkpoint)
