"""The jobs' records of a campaign whose state is on shared storage: copied beside its ledger
after each job (missing or grown files only, so a sync that failed is caught up), restored into
a workdir that lacks them, and nothing but a job record's name is ever written into a workdir.
A shared directory is the state location here (S3 end to end: test_state_uri_campaign)."""

from __future__ import annotations

import pytest

from pretrain.state.job_records import keep_records, local_records, restore_records
from trainer.storage import StorageUnreachable, open_storage


def job_files(workdir, files: dict[str, str]) -> None:
    for key, text in files.items():
        path = workdir / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


RECORDS = {
    "jobs/main/attempt_000/events.jsonl": "e\n",
    "jobs/main/attempt_000/metrics.jsonl": "m\n",
    "jobs/main/attempt_000/node0.log": "log\n",
    "jobs/warmup/attempt_001/events.jsonl": "e\n",
}
NOT_RECORDS = {
    "jobs/main/attempt_000/job.json": "{}",
    "jobs/main/attempt_000/heartbeat/agent1-local0.json": "{}",
    "jobs/main/.node0.lock": "",
    "jobs/main/attempt_x/events.jsonl": "e\n",
}


@pytest.fixture
def state(tmp_path):
    return open_storage(str(tmp_path / "state"))


def test_a_job_s_records_are_copied_once_and_again_only_when_they_grew(tmp_path, state):
    job_files(tmp_path / "a", {**RECORDS, **NOT_RECORDS})
    assert sorted(keep_records(state, tmp_path / "a").files) == sorted(RECORDS)
    assert keep_records(state, tmp_path / "a").files == []  # nothing changed: nothing copied
    (tmp_path / "a" / "jobs/main/attempt_000/events.jsonl").write_text("e\nmore\n")  # a job adopted and run on
    assert keep_records(state, tmp_path / "a").files == ["jobs/main/attempt_000/events.jsonl"]
    assert state.get_bytes("jobs/main/attempt_000/events.jsonl") == b"e\nmore\n"


def test_a_workdir_that_lacks_them_gets_them_back_and_keeps_its_own(tmp_path, state):
    job_files(tmp_path / "a", RECORDS)
    keep_records(state, tmp_path / "a")
    job_files(tmp_path / "b", {"jobs/main/attempt_000/node0.log": "newer\n"})
    restored = restore_records(state, tmp_path / "b")
    assert sorted(restored.files) == sorted(set(RECORDS) - {"jobs/main/attempt_000/node0.log"})
    assert {k: p.read_text() for k, p in local_records(tmp_path / "b").items()} == {
        **RECORDS,
        "jobs/main/attempt_000/node0.log": "newer\n",
    }
    assert restore_records(state, tmp_path / "b").files == []


@pytest.mark.parametrize(
    "key",
    [
        "jobs/main/attempt_000/job.json",
        "jobs/.hidden/attempt_000/events.jsonl",
        "jobs/main/attempt_000/heartbeat/x.json",
        "ledger.json",
        "jobs/events.jsonl",
    ],
)
def test_nothing_but_a_job_record_is_written_into_a_workdir(tmp_path, state, key):
    state.put_bytes(key, b"foreign")
    assert restore_records(state, tmp_path / "b").files == []
    assert not (tmp_path / "b" / key).exists()


def test_storage_that_is_not_there_is_an_error_for_the_caller_to_report(tmp_path, monkeypatch):
    job_files(tmp_path / "a", RECORDS)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    unreachable = open_storage("s3://bucket/state", endpoint_url="http://127.0.0.1:9", max_attempts=1)
    with pytest.raises(StorageUnreachable, match="s3://bucket/state/jobs/"):
        keep_records(unreachable, tmp_path / "a")


def test_a_run_that_lost_the_campaign_s_lease_copies_no_job_records(tmp_path):
    """A run whose lease another run took over writes no more of the campaign's state: its jobs'
    records included (the holder's records of the same names are not replaced); while it holds
    the lease, they are copied."""
    from prefect.logging import disable_run_logger

    from pretrain.settings import PretrainSettings
    from pretrain.state.guard import LEASE_KEY, campaign_guard, held, state_storage
    from support.campaigns import small_spec, wait_for
    from tasks.job_records import keep_job_records
    from trainer.checkpoint.fence import LeaseRecord

    spec = small_spec(tmp_path / "wd", checkpoint={"state_uri": str(tmp_path / "state")})
    job_files(spec.workdir_path, RECORDS)
    with (
        campaign_guard(spec, "run-A", settings=PretrainSettings(lease_ttl_s=3, lease_margin_s=0)),
        disable_run_logger(),
    ):
        assert sorted(keep_job_records.fn(spec)) == sorted(RECORDS)
        job_files(spec.workdir_path, {"jobs/main/attempt_002/events.jsonl": "e\n"})
        state_storage(spec).put_bytes(
            LEASE_KEY,
            LeaseRecord(holder="run B on host-b", generation=2, token="b", expires_at=4e9, ttl_s=60).to_bytes(),
        )
        wait_for(lambda: held(spec).lost, 30, "the keeper to find the lease lost")
        assert keep_job_records.fn(spec) == []
    assert "jobs/main/attempt_002/events.jsonl" not in state_storage(spec).list("jobs/")
