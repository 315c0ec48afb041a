"""`pretrain status` / `report` without --workdir: the one campaign `pretrain run` made here
(./runs/{name}, the specs' default), or a message that says what to pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretrain.cli.workdir_lookup import pick_workdir
from pretrain.state.ledger import Ledger
from pretrain.views.status import NoCampaign
from support.campaigns import pretrain_cli, small_spec


def campaign(workdir: Path, name: str = "c") -> Path:
    Ledger.open(small_spec(workdir, name=name)).begin_run("flow-run-1")  # what `pretrain run` leaves
    return workdir


@pytest.mark.parametrize(
    "made, expected",
    [
        (["runs/tiny"], "runs/tiny"),
        (["."], "."),
        (["runs/tiny", "runs/empty-dir-without-ledger/"], "runs/tiny"),
    ],
)
def test_the_one_campaign_here_is_found(tmp_path, made, expected):
    for rel in made:
        (tmp_path / rel).mkdir(parents=True, exist_ok=True)
        if not rel.endswith("/"):
            campaign(tmp_path / rel)
    assert pick_workdir(None, here=tmp_path) == tmp_path / expected


@pytest.mark.parametrize(
    "made, says",
    [
        ([], "no campaign in"),
        (["runs/a", "runs/b"], "2 campaigns here (runs/a, runs/b): pass --workdir DIR"),
        ([".", "runs/a"], "2 campaigns here (., runs/a)"),
    ],
)
def test_none_or_several_say_what_to_pass(tmp_path, made, says):
    for rel in made:
        campaign(tmp_path / rel)
    with pytest.raises(NoCampaign, match=r"--workdir") as raised:
        pick_workdir(None, here=tmp_path)
    assert says in str(raised.value)


def test_a_given_workdir_is_taken_as_it_is(tmp_path):
    campaign(tmp_path / "runs" / "a")
    assert pick_workdir(tmp_path / "elsewhere", here=tmp_path) == tmp_path / "elsewhere"


def test_status_without_workdir_shows_the_campaign_run_made_here(tmp_path, monkeypatch):
    campaign(tmp_path / "runs" / "tiny", name="mine")
    monkeypatch.chdir(tmp_path)
    shown = pretrain_cli("status")
    assert shown.returncode == 0, shown.stderr
    assert "campaign mine" in shown.stdout
    monkeypatch.chdir(tmp_path / "runs")  # nothing here: one line, what to pass
    missing = pretrain_cli("status")
    assert missing.returncode == 2 and "pass --workdir" in missing.stderr and "Traceback" not in missing.stderr
    no_checkpoint = pretrain_cli("eval")
    assert no_checkpoint.returncode == 2 and "pass a checkpoint" in no_checkpoint.stderr


def test_eval_without_a_checkpoint_takes_the_newest_good_one_of_the_campaign_here(tmp_path):
    from pretrain.cli.workdir_lookup import good_checkpoint
    from pretrain.state.schema import VerdictRecord

    workdir = campaign(tmp_path / "runs" / "tiny")
    with pytest.raises(NoCampaign, match="no good checkpoint yet: pass a checkpoint"):
        good_checkpoint(here=tmp_path)
    ledger = Ledger.open(small_spec(workdir, name="c"))  # stages warmup, main
    ledger.record_verdict("warmup", VerdictRecord(step=4, path=str(workdir / "w" / "step_4"), verdict="good"))
    assert good_checkpoint(here=tmp_path) == str(workdir / "w" / "step_4")
    ledger.record_verdict("main", VerdictRecord(step=8, path=str(workdir / "m" / "step_8"), verdict="good"))
    ledger.record_verdict("main", VerdictRecord(step=6, path=str(workdir / "m" / "step_6"), verdict="bad"))
    assert good_checkpoint(here=tmp_path) == str(workdir / "m" / "step_8")  # the last stage's newest good one
    with pytest.raises(NoCampaign, match="pass a checkpoint"):
        good_checkpoint(here=tmp_path / "runs" / "tiny" / "nothing-here-either")
