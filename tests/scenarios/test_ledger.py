"""A damaged ledger.json is one clear error naming the file and how to recover; every save keeps
the previous generation (ledger.json.prev), which `pretrain recover-ledger` restores."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from pretrain.cli.app import app
from pretrain.spec.layout import CampaignLayout
from pretrain.state.ledger import Ledger, LedgerDamaged, LedgerError
from pretrain.state.local import recover_ledger
from pretrain.state.schema import CampaignStatus, CheckpointRecord, Failure, StageStatus
from pretrain.views.status import campaign_status
from support.campaigns import pretrain_cli, small_spec
from trainer.checkpoint.store import CheckpointStore, rank_shard_name


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _edit(change):
    def edit(path):
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))

    return edit


DAMAGE = {
    "truncated": (_truncate, "not valid JSON"),
    "not JSON": (lambda p: p.write_bytes(b"\x00\xff garbage"), "not valid JSON"),
    "empty": (lambda p: p.write_bytes(b""), "not valid JSON"),
    "a list": (lambda p: p.write_text("[]"), "not a JSON object"),
    "no stages": (_edit(lambda d: d.pop("stages")), "'stages'"),
    "stages a list": (_edit(lambda d: d.update(stages=[])), "'stages'"),
    "stage without status": (_edit(lambda d: d["stages"]["warmup"].pop("status")), "'status'"),
    "attempts a string": (_edit(lambda d: d["stages"]["main"].update(attempts="2")), "'attempts'"),
    "verdict without verdict": (_edit(lambda d: d["stages"]["main"]["verdicts"].append({"step": 4})), "'verdict'"),
    "a directory": (lambda p: (p.unlink(), p.mkdir()), "a directory, not a file"),
}


@pytest.fixture
def spec(tmp_path):
    spec = small_spec(tmp_path / "w")
    ledger = Ledger.open(spec)
    ledger.save()
    ledger.begin_run("a-flow-run")  # a second generation: .prev holds the first
    return spec


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_ledger_is_one_clear_error_offering_the_previous_generation(spec, damage):
    layout = spec.layout
    harm, what = DAMAGE[damage]
    harm(layout.ledger)

    with pytest.raises(LedgerDamaged) as err:
        Ledger.open(spec)

    msg = str(err.value)
    assert str(layout.ledger) in msg and what in msg, msg
    assert "ledger.json.prev is intact" in msg and f"pretrain recover-ledger --workdir {layout.root}" in msg


def test_every_save_keeps_the_previous_generation(spec):
    layout = spec.layout
    before = layout.ledger.read_bytes()
    Ledger.open(spec).set_status(CampaignStatus.COMPLETED)
    assert layout.ledger.with_name("ledger.json.prev").read_bytes() == before
    assert json.loads(layout.ledger.read_text())["status"] == "completed"


def test_an_update_that_changes_nothing_keeps_both_generations(spec):
    """(A run refused before it started has its failure hook look at the ledger: nothing to record.)"""
    layout = spec.layout
    prev = layout.ledger.with_name("ledger.json.prev")
    before = (layout.ledger.read_bytes(), prev.read_bytes())
    Ledger.open(spec).mutate(lambda r: None)
    assert (layout.ledger.read_bytes(), prev.read_bytes()) == before


def test_two_threads_updating_the_ledger_lose_no_update(spec):
    """The flow thread and `pretrain run`'s stop at once write the ledger of one process at the same
    time: each read-modify-write holds the ledger's update lock, so every update lands."""
    import threading

    writers, each = 4, 25
    ledgers = [Ledger.open(spec) for _ in range(writers)]  # each its own instance, as each thread has
    start = threading.Barrier(writers)

    def bump(ledger):
        start.wait()
        for _ in range(each):
            ledger.mutate(lambda r: setattr(r, "invocations", r.invocations + 1))

    threads = [threading.Thread(target=bump, args=(ledger,)) for ledger in ledgers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Ledger.open(spec).record.invocations == 1 + writers * each


def test_status_and_run_refuse_a_damaged_ledger_and_recover_ledger_restores_it(spec, tmp_path):
    root = spec.workdir_path
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    _truncate(root / "ledger.json")

    for args in (("status", "--workdir", str(root)), ("run", str(spec_file), "--workdir", str(root))):
        proc = pretrain_cli(*args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
        assert "ledger.json is damaged" in proc.stderr and "pretrain recover-ledger" in proc.stderr, proc.stderr

    proc = pretrain_cli("recover-ledger", "--workdir", str(root))

    assert proc.returncode == 0, proc.stderr
    (aside,) = root.glob("ledger.json.damaged-*")  # kept, never deleted
    assert str(aside) in proc.stdout and json.loads((root / "ledger.json").read_text())["status"] == "new"
    assert pretrain_cli("status", "--workdir", str(root)).returncode == 0


def test_a_run_of_another_spec_is_refused_in_one_line_and_writes_nothing(spec, tmp_path):
    root = spec.workdir_path
    other = spec.model_dump(mode="json")
    other["stages"][0]["steps"] += 1  # a typo in the spec, or the wrong spec for this workdir
    spec_file = tmp_path / "other.yaml"
    spec_file.write_text(yaml.safe_dump(other))
    before = {p.name: p.read_bytes() for p in root.iterdir()}

    proc = pretrain_cli("run", str(spec_file), "--workdir", str(root))

    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert "resume it with its original spec" in proc.stderr and "Flow run" not in proc.stderr + proc.stdout
    assert {p.name: p.read_bytes() for p in root.iterdir()} == before  # both generations kept as they were


def test_a_workdir_that_is_a_file_is_one_line_in_every_command(tmp_path):
    afile = tmp_path / "notes.txt"
    afile.write_text("not a campaign")
    for args in (("status",), ("status", "--json"), ("report",), ("recover-ledger",), ("run",)):
        proc = pretrain_cli(*args, "--workdir", str(afile))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout, (args, proc.stderr)
        assert "not a directory" in proc.stderr, (args, proc.stderr)
    assert afile.read_text() == "not a campaign"


@pytest.mark.parametrize(
    "make, says",
    [
        (
            lambda tmp: (tmp / "notes.txt").write_text("x") and tmp / "notes.txt" / "campaign",
            "{tmp}/notes.txt is a file, not a directory",
        ),
        (lambda tmp: Path("/proc") / f"pretrain-{tmp.name}", "cannot make the workdir /proc/pretrain-"),
    ],
    ids=["under a file", "cannot be made"],
)
def test_run_and_data_prepare_refuse_a_workdir_they_cannot_use_before_anything_starts(tmp_path, make, says):
    """Not ~10 s later from inside the flow as "campaign failed: [Errno 2] …": one line naming
    what is in the way and what to give, before the Prefect API server or the flow starts."""
    workdir = make(tmp_path)
    for args in (["run"], ["data", "prepare"]):
        done = CliRunner().invoke(app, [*args, "--workdir", str(workdir)])
        text = " ".join(done.output.split())
        assert done.exit_code == 2 and "Traceback" not in text, (args, done.output)
        assert says.format(tmp=tmp_path) in text and "give a directory you can write to" in text, (args, text)
        assert "Prefect API server" not in text and "Flow run" not in text, (args, text)  # nothing started


def test_a_campaign_without_an_mlflow_run_yet_says_so_in_status_and_report(spec):
    """A campaign stopped (or looked at) before it opened its MLflow run: not 'parent run None'."""
    done = CliRunner().invoke(app, ["status", "--workdir", str(spec.workdir_path)])
    assert done.exit_code == 0 and "MLflow: no run yet" in done.output and "None" not in done.output, done.output
    done = CliRunner().invoke(app, ["report", "--workdir", str(spec.workdir_path)])
    page = (spec.workdir_path / "report" / "report.html").read_text()
    assert done.exit_code == 0 and "MLflow: no run yet" in page and "None" not in page, done.output


def test_without_an_intact_previous_generation_the_error_says_what_to_do(spec):
    layout = spec.layout
    _truncate(layout.ledger)
    _truncate(layout.ledger.with_name("ledger.json.prev"))

    with pytest.raises(LedgerDamaged, match="no intact previous generation") as err:
        recover_ledger(layout.root)

    assert "checkpoints" in str(err.value) and layout.ledger.exists()  # nothing moved, nothing lost
    assert not list(layout.root.glob("ledger.json.damaged-*"))


def test_recover_ledger_leaves_an_intact_ledger_alone(spec):
    layout = spec.layout
    before = layout.ledger.read_bytes()
    with pytest.raises(LedgerError, match="is intact"):
        recover_ledger(layout.root)
    assert layout.ledger.read_bytes() == before


# ledger.json of a real run on main 6b4a8a5, the last release writing ledger version 1 (no
# "version" key): tests/scenarios/test_resume.py::test_failed_job_is_relaunched_from_the_last_checkpoint,
# its workdir replaced by {WORKDIR}. A failed job (in_job false), two launches, four verdicts.
RELEASE_BEFORE = Path(__file__).parents[1] / "data" / "ledger_v1_release_before.json"


def _release_before_workdir(tmp_path) -> tuple[Path, dict]:
    """A workdir holding the release-before ledger, and that ledger as it was written."""
    from test_resume import ONE_STAGE, SLOW_MODEL

    workdir = tmp_path / "w"
    workdir.mkdir()
    text = RELEASE_BEFORE.read_text().replace("{WORKDIR}", str(workdir))
    (workdir / "ledger.json").write_text(text)
    spec = small_spec(
        workdir,
        model=SLOW_MODEL,
        stages=ONE_STAGE,
        checkpoint={"interval": 10, "memory_interval": 5, "keep": 5},
        cluster={"workers_per_node": 2, "max_restarts": 0},
    )
    return spec, json.loads(text)


def test_a_ledger_written_by_the_release_before_is_read_and_resumed(tmp_path):
    spec, before = _release_before_workdir(tmp_path)
    layout = spec.layout

    ledger = Ledger.open(spec)  # the same spec: its workdir, not refused as another campaign's
    stage = ledger.stage("main")
    assert ledger.record.status == CampaignStatus.COMPLETED and stage.status == StageStatus.COMPLETED
    assert stage.attempts == 2 and [(f.attempt, f.in_job, f.exit_code) for f in stage.failures] == [(0, False, 1)]
    assert [r.source for r in stage.resumes if r.attempt == 1] == ["checkpoint"]
    assert stage.good_checkpoint.step == stage.final_checkpoint.step == 40 and len(stage.verdicts) == 4
    assert stage.resizes == [] and stage.rewinds == []  # keys it lacks: their defaults

    # a new run resumes it: every write keeps what the old file said
    ledger.begin_run("next-run")
    assert layout.ledger.with_name("ledger.json.prev").read_text() == RELEASE_BEFORE.read_text().replace(
        "{WORKDIR}", str(spec.workdir_path)
    )  # .prev: the old file, as it was
    attempt = ledger.start_attempt("main")
    ledger.record_failure("main", Failure(attempt=attempt, cause="hang", in_job=True, action="restart workers"))
    after = json.loads(layout.ledger.read_text())
    assert (
        after["version"] == 2 and after["invocations"] == before["invocations"] + 1 and after["flow_run"] == "next-run"
    )
    assert {
        k: v for k, v in after.items() if k in before and k not in ("status", "invocations", "flow_run", "stages")
    } == {k: v for k, v in before.items() if k not in ("status", "invocations", "flow_run", "stages")}
    old, new = before["stages"]["main"], after["stages"]["main"]
    assert {k: new[k] for k in old if k not in ("attempts", "failures")} == {
        k: v for k, v in old.items() if k not in ("attempts", "failures")
    }
    assert new["attempts"] == 3 and new["failures"][0] == old["failures"][0] and new["failures"][1]["cause"] == "hang"

    status = campaign_status(spec.workdir_path)  # what `pretrain status --json` shows
    assert status["stages"][0]["attempts"] == 3 and status["stages"][0]["failures"][0] == old["failures"][0]
    assert status["stages"][0]["resumes"] == old["resumes"] and status["invocations"] == before["invocations"] + 1


def test_a_ledger_of_a_newer_release_is_refused_saying_so(tmp_path):
    spec, before = _release_before_workdir(tmp_path)
    (spec.workdir_path / "ledger.json").write_text(json.dumps({**before, "version": 3}))

    with pytest.raises(
        LedgerError,
        match=r"ledger\.json was written by a newer prefect-pretrain \(ledger version 3; "
        r"this release reads up to 2\): .*upgrade",
    ) as err:
        Ledger.open(spec)
    assert not isinstance(err.value, LedgerDamaged)  # nothing to recover: the file is sound


def test_a_resumed_job_span_continues_the_open_span_of_its_dead_process(spec):
    """An adopted job's span runs from its launch (the process that opened it died) to its end
    in the re-run; without an open span of that attempt a new one is opened."""
    from pretrain.state.schema import Span, SpanKind

    ledger = Ledger.open(spec)
    dead = Span(kind=SpanKind.JOB, start=1000.0, stage="warmup", attempt=0)  # what a SIGKILLed process leaves
    ledger.mutate(lambda r: r.spans.append(dead))
    with ledger.timed(SpanKind.JOB, "warmup", 0, resume=True):
        pass
    with ledger.timed(SpanKind.JOB, "warmup", 1, resume=True):
        pass
    [adopted, fresh] = Ledger.open(spec).record.spans
    assert adopted.start == dead.start and adopted.end is not None and adopted.attempt == 0
    assert fresh.attempt == 1 and fresh.start >= adopted.start and fresh.end is not None


def test_a_moved_campaign_shows_its_checkpoints_and_its_next_run_records_the_new_place(spec, tmp_path):
    store = CheckpointStore.open(spec.layout.ckpt_dir("main"))
    shards = [store.write_shard(4, "model.pt", {"w": torch.zeros(2)}), store.write_shard(4, rank_shard_name(0), {})]
    store.write_node_record(4, "model", 1, shards)
    store.commit(4, shards, {"stage": "main", "world_size": 1})
    store.set_verdict(4, {"verdict": "good", "problems": []})
    Ledger.open(spec).mutate(
        lambda r: setattr(r.stages["main"], "good_checkpoint", CheckpointRecord(step=4, path=store.ref(4).location))
    )
    moved = tmp_path / "elsewhere" / "c1"
    shutil.move(spec.workdir_path, moved)  # to a bigger disk, say

    def main_stage() -> dict:
        return next(s for s in campaign_status(moved)["stages"] if s["name"] == "main")

    assert main_stage()["steps_done"] == 4 and "moved or copied" in main_stage()["problems"][0]

    Ledger.read(CampaignLayout(moved)).begin_run("after-the-move", spec.with_workdir(moved))
    record = Ledger.read(CampaignLayout(moved)).record.stages["main"]
    assert record.checkpoints == str(moved / "checkpoints" / "main")
    assert record.good_checkpoint.path == str(moved / "checkpoints" / "main" / "step_00000004")  # what init_from takes
    assert main_stage()["steps_done"] == 4 and main_stage()["problems"] == []
