"""A whole campaign whose state lives on S3 (``checkpoint.state_uri``, SeaweedFS on 127.0.0.1):
it pauses, its orchestrator's disk is lost, and a run from another workdir finishes it from
its checkpoints — nothing trained twice; ``pretrain status``/``report`` read its workdir's copy of
the ledger. The copy's rules (read-only, newest revision wins, never over another campaign's
ledger) on a shared directory as the state location, without servers."""

from __future__ import annotations

import json
import shutil
import uuid

import pytest
from test_pause import run_until_budget_ends_after_first_checkpoint
from test_resume import SLOW_MODEL, assert_mlflow_steps_unique
from typer.testing import CliRunner

from flows.campaign import pretrain_campaign
from pretrain.cli.app import app
from pretrain.state.ledger import Ledger, LedgerError
from pretrain.state.schema import StageStatus
from pretrain.views.report import write_report_files
from pretrain.views.status import campaign_status
from support import s3_servers
from support.campaigns import seed_data, small_spec
from support.s3_servers import BUCKET

seaweed, aws_env = s3_servers.seaweed, s3_servers.aws_env
STAGES = [
    {"name": "warmup", "steps": 4, "seq_len": 32, "micro_batch": 4, "warmup_steps": 2},
    {"name": "main", "steps": 40, "seq_len": 64, "micro_batch": 8, "warmup_steps": 5},
]


def state_spec(workdir, checkpoint: dict, **overrides):
    return small_spec(workdir, checkpoint={"interval": 10, "memory_interval": 5, "keep": 3, **checkpoint}, **overrides)


def test_a_campaign_with_state_on_s3_survives_losing_its_orchestrators_disk(
    prefect_harness, prepared_data, tmp_path, seaweed, aws_env
):
    prefix = f"s3://{BUCKET}/campaign-{uuid.uuid4().hex[:8]}"
    where = {"uri": f"{prefix}/checkpoints", "state_uri": f"{prefix}/state", "s3_endpoint_url": seaweed.endpoint}

    def on(workdir):
        spec = state_spec(workdir, where, model=SLOW_MODEL, stages=STAGES)
        seed_data(spec, prepared_data, own_store=False)  # MLflow outside the workdir: a server's, in effect
        return spec

    first = on(tmp_path / "a")
    status = run_until_budget_ends_after_first_checkpoint(first)
    assert status["status"] == "paused"
    copy = json.loads((first.workdir_path / "ledger.json").read_text())
    assert copy["copy_of"] == f"{prefix}/state/ledger.json" and copy["end"]["state"] == "paused"
    paused_at = copy["end"]["step"]
    shown = CliRunner().invoke(app, ["status", "--workdir", str(first.workdir_path)])
    assert shown.exit_code == 0 and "paused" in shown.output and "State: the campaign's ledger is" in shown.output, (
        shown.output
    )

    shutil.rmtree(first.workdir_path)  # the orchestrator's disk is gone; S3 holds the state and checkpoints
    second = on(tmp_path / "b")
    status = pretrain_campaign(spec=second)
    warmup, main = status["stages"]
    assert (status["status"], status["invocations"]) == ("completed", 2)
    assert (warmup["status"], warmup["attempts"], main["steps_done"]) == (
        "completed",
        1,
        40,
    )  # warmup not trained again
    [resumed] = [r for r in main["resumes"] if r["attempt"] == 1]
    assert (resumed["source"], resumed["step"]) == ("checkpoint", paused_at)
    assert main["good_checkpoint"]["path"] == f"{prefix}/checkpoints/main/step_00000040"
    _, runs = assert_mlflow_steps_unique(second)  # the first run's MLflow runs went on: no step logged twice
    assert {r.info.status for r in runs} == {"FINISHED"}

    # the first workdir's job records came back from S3: the goodput split misses none of its jobs
    for stage in ("warmup", "main"):
        assert (second.workdir_path / "jobs" / stage / "attempt_000" / "events.jsonl").is_file()
    assert [m for s in status["stages"] for m in s["goodput"]["missing"] if "no records of job" in m] == []
    # what reads a workdir reads the copy: status, the report and its pictures
    assert campaign_status(second.workdir_path)["status"] == "completed"
    files = write_report_files(second.workdir_path, tmp_path / "report")
    assert all(p.stat().st_size > 0 for p in files.values())
    assert (
        Ledger.of_spec(second).record.revision
        == json.loads((second.workdir_path / "ledger.json").read_text())["revision"]
    )


@pytest.fixture
def shared(tmp_path):
    """A campaign (not run) whose state lives in a shared directory, its ledger created."""
    spec = state_spec(tmp_path / "wd", {"state_uri": str(tmp_path / "shared" / "state")})
    spec.workdir_path.mkdir(parents=True)
    Ledger.open(spec).set_stage_status("warmup", StageStatus.RUNNING)
    return spec


def test_the_workdirs_copy_follows_the_ledger_and_refuses_changes(shared):
    ledger = Ledger.of_spec(shared)
    ledger.set_stage_status("warmup", StageStatus.COMPLETED)
    copy = Ledger.read(ledger.layout)
    assert copy.record.copy_of == ledger.remote.where and copy.record.revision == ledger.record.revision == 2
    assert copy.record.stages["warmup"].status == StageStatus.COMPLETED
    with pytest.raises(LedgerError, match="read-only copy .* run the campaign with its spec"):
        copy.set_status("failed")
    with pytest.raises(LedgerError, match="read-only copy"):
        copy.save()
    assert "copy_of" not in (shared.workdir_path.parent / "shared" / "state" / "ledger.json").read_text()


def test_an_older_revision_never_replaces_a_newer_copy(shared):
    slow, fast = Ledger.of_spec(shared), Ledger.of_spec(shared)
    fast.set_stage_status("warmup", StageStatus.COMPLETED)  # revision 2 reaches the copy first
    from pretrain.state.remote import keep_copy

    keep_copy(slow.layout.ledger, slow.record, slow.remote.where)  # a slower thread's revision 1, late
    assert Ledger.read(slow.layout).record.stages["warmup"].status == StageStatus.COMPLETED


def test_a_campaign_with_state_elsewhere_never_overwrites_a_workdirs_own_ledger(tmp_path, shared):
    local = small_spec(tmp_path / "local")
    local.workdir_path.mkdir()
    Ledger.open(local).set_stage_status("warmup", StageStatus.COMPLETED)
    before = (local.workdir_path / "ledger.json").read_bytes()
    moved = state_spec(local.workdir_path, {"state_uri": str(tmp_path / "shared" / "state")})
    with pytest.raises(LedgerError, match="holds the ledger of campaign 't', kept in that workdir.*workdir of its own"):
        Ledger.open(moved)
    other = state_spec(shared.workdir_path, {"state_uri": str(tmp_path / "elsewhere")})
    with pytest.raises(LedgerError, match="keeps a copy of the ledger .*shared/state/ledger.json"):
        Ledger.open(other)
    assert (local.workdir_path / "ledger.json").read_bytes() == before
