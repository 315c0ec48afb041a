"""Live training progress: what the job's files and the ledger say about a training stage
(``pretrain.views.training_progress``), and ``pretrain status --watch`` following a campaign from another
terminal, under a pseudo-terminal (a bar) and piped (lines), ending when the campaign stops."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.state.ledger import Ledger
from pretrain.state.schema import StageStatus, VerdictRecord
from pretrain.views.follow import CampaignFollower
from pretrain.views.training_progress import TrainingWatch
from support.campaigns import small_spec, wait_for
from support.terminal import Terminal


def write_lines(path: Path, *records: dict | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        for r in records:
            f.write(r if isinstance(r, bytes) else (json.dumps(r) + "\n").encode())


def metric(step: int, t: float, loss: float = 3.0) -> dict:
    return {"step": step, "time": t, "loss": loss, "tokens_per_s": 1500.0, "lr": 1e-3}


@pytest.fixture
def ledger(tmp_path):
    spec = small_spec(tmp_path / "w", stages=[{"name": "main", "steps": 100, "seq_len": 32, "micro_batch": 4}])
    return Ledger.open(spec)


def watch_of(ledger, attempt: int = 0) -> TrainingWatch:
    layout = ledger.layout
    return TrainingWatch(
        layout.job_dir("main", attempt), "main", attempt, 100, lambda: Ledger.read(layout).record.stages["main"]
    )


def test_a_stage_before_its_first_step_shows_no_numbers(ledger):
    snap = watch_of(ledger).poll()
    assert (snap.step, snap.loss, snap.eta_s, snap.checkpoint_step, snap.restarts) == (-1, None, None, None, 0)
    assert snap.line() == "stage main: step 0/100 (0.0%), restarts 0"


@pytest.mark.parametrize("verdict, shown", [(None, "pending"), ("good", "good"), ("bad", "bad")])
def test_step_loss_rate_eta_and_the_newest_checkpoint_with_its_verdict(ledger, verdict, shown):
    job = ledger.layout.job_dir("main", 0)
    write_lines(
        job / "metrics.jsonl",
        metric(10, 1000.0),
        metric(20, 1010.0, loss=2.5),
        b"{damaged\n",
        metric(30, 1020.0, loss=2.25),
    )
    write_lines(job / "events.jsonl", {"event": "checkpoint", "step": 20, "path": "x/step_20", "time": 1011.0})
    if verdict:
        ledger.record_verdict("main", VerdictRecord(step=20, path="x/step_20", verdict=verdict))
    snap = watch_of(ledger).poll()
    assert (snap.step, snap.loss, snap.tokens_per_s) == (30, 2.25, 1500.0)
    assert snap.eta_s == pytest.approx(70.0)  # 1 step/s by the job's own clock, 70 steps to go
    assert (snap.checkpoint_step, snap.checkpoint_verdict) == (20, shown)
    assert (
        snap.line()
        == f"stage main: step 30/100 (30.0%), loss 2.25, tok/s 1.5k, ETA 0:01:10, restarts 0, checkpoint 20 {shown}"
    )


def test_restarts_count_relaunches_earlier_and_in_job_restarts_and_a_resume_restarts_the_pace(ledger):
    ledger.add_restarts("main", 2)  # in-job restarts of attempts 0 and 1
    job = ledger.layout.job_dir("main", 2)
    write_lines(job / "events.jsonl", {"event": "start", "rank": 0, "restart_count": 1, "step": 20, "time": 1.0})
    write_lines(job / "metrics.jsonl", metric(30, 100.0), metric(40, 110.0), metric(22, 130.0))  # resumed at 20
    watch = watch_of(ledger, attempt=2)
    snap = watch.poll()
    assert (snap.restarts, snap.step, snap.eta_s) == (2 + 2 + 1, 22, None)  # one sample since the resume: no pace yet
    write_lines(job / "metrics.jsonl", metric(32, 135.0), b'{"step": 34, "time": 1')  # the writer is mid-line
    snap = watch.poll()
    assert snap.step == 32 and snap.eta_s == pytest.approx(34.0)
    assert watch.poll(final=True).step == 32  # a damaged last line of a dead writer: skipped


def test_a_lost_worker_replaced_while_the_others_kept_running_counts_as_a_restart_a_rollback_does_not(ledger):
    job = ledger.layout.job_dir("main", 0)
    write_lines(
        job / "events.jsonl",
        {"event": "rollback", "rank": 0, "path": "in_process", "step": 4, "time": 1.0},  # NaN: no process lost
        {"event": "rollback", "rank": 1, "path": "in_process", "step": 4, "time": 1.0},
        {"event": "rollback", "rank": 0, "path": "spare", "lost_ranks": [1], "step": 6, "time": 2.0},
        {"event": "start", "rank": 1, "restart_count": 0, "epoch": 1, "step": 6, "time": 2.0},  # the spare
        {"event": "rollback", "rank": 0, "path": "replacement", "lost_ranks": [1], "step": 8, "time": 3.0},
    )
    assert watch_of(ledger).poll().restarts == 2


def test_the_followed_attempts_restarts_count_once_after_its_job_ended_and_the_ledger_added_them(ledger):
    """The live line's last poll comes after the flow recorded the finished job's restarts in
    the ledger: they were shown twice (the drills campaign ended on "restarts 4" for 2)."""
    ledger.add_restarts("main", 1)  # attempt 0's
    job = ledger.layout.job_dir("main", 1)
    write_lines(
        job / "events.jsonl",
        {"event": "rollback", "rank": 0, "path": "spare", "lost_ranks": [1], "step": 6, "time": 2.0},
    )
    watch = watch_of(ledger, attempt=1)
    assert watch.poll().restarts == 1 + 1 + 1  # the relaunch, attempt 0's, the spare
    ledger.add_restarts("main", 1)  # the job ended: the flow records its restarts
    assert watch.poll(final=True).restarts == 3


def test_a_damaged_ledger_leaves_the_jobs_own_numbers(ledger):
    write_lines(ledger.layout.job_dir("main", 0) / "metrics.jsonl", metric(5, 1.0))
    ledger.layout.ledger.write_text("{not json")
    snap = watch_of(ledger).poll()
    assert snap.step == 5 and snap.checkpoint_step is None


# ---- pretrain status --watch -----------------------------------------------------------------


def running_campaign(ledger, holder_pid: int) -> Path:
    """The workdir as a campaign training stage main (attempt 0) leaves it, its lock file naming
    ``holder_pid`` on this host."""
    ledger.begin_run("flow-run-1")
    ledger.set_stage_status("main", StageStatus.RUNNING)
    ledger.start_attempt("main")
    root = ledger.layout.root
    (root / "campaign.lock").write_text(json.dumps({"pid": holder_pid, "host": socket.gethostname(), "since": 0}))
    write_lines(ledger.layout.job_dir("main", 0) / "metrics.jsonl", metric(10, 1000.0), metric(20, 1010.0))
    return root


def test_the_follower_shows_a_stage_once_more_after_it_ended_with_its_last_checkpoints_verdict(ledger):
    """``pretrain run``'s last line of a stage says what became of its last checkpoint, not
    "pending": the gate judges it after the job ended, when the stage no longer runs."""
    root = running_campaign(ledger, os.getpid())
    write_lines(
        ledger.layout.job_dir("main", 0) / "events.jsonl",
        {"event": "checkpoint", "step": 20, "path": "x/step_20", "time": 1011.0},
    )
    follower = CampaignFollower(root)
    assert follower.look().line().endswith("checkpoint 20 pending")
    ledger.record_verdict("main", VerdictRecord(step=20, path="x/step_20", verdict="good"))
    ledger.set_stage_status("main", StageStatus.COMPLETED)
    last = follower.look()
    assert last.step == 20 and last.line().endswith("checkpoint 20 good")
    assert follower.look() is None  # once


def holder() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])


def watch_cmd(root: Path) -> list[str]:
    return [sys.executable, "-m", "pretrain.cli.app", "status", "--watch", "--interval", "0.2", "--workdir", str(root)]


def test_status_watch_piped_prints_lines_and_ends_when_the_campaign_process_is_gone(ledger, tmp_path):
    runner = holder()
    try:
        root = running_campaign(ledger, runner.pid)
        out, err = tmp_path / "out", tmp_path / "err"
        with open(out, "w") as o, open(err, "w") as e:
            proc = subprocess.Popen(watch_cmd(root), stdout=o, stderr=e, stdin=subprocess.DEVNULL)
        wait_for(lambda: "20/100" in err.read_text(), 60, "a progress line")
        assert proc.poll() is None  # follows while the campaign runs
        write_lines(ledger.layout.job_dir("main", 0) / "metrics.jsonl", metric(55, 1020.0, loss=1.5))
        write_lines(
            ledger.layout.job_dir("main", 0) / "events.jsonl",
            {
                "event": "rollback",
                "rank": 0,
                "path": "spare",
                "lost_ranks": [1],
                "step": 54,
                "source": "survivors",
                "seconds": 0.1,
                "time": 1019.0,
            },
        )
        wait_for(lambda: "55/100" in err.read_text() and "lost" in err.read_text(), 60, "the next progress line")
    finally:
        runner.kill()
        runner.wait()
    assert proc.wait(60) == 0  # the campaign's process is gone: the watch ends by itself
    text = err.read_text()
    assert "training: stage main 20% 20/100, loss 3, tok/s 1.5k, ETA 0:01:20, restarts 0" in text
    assert "training: stage main 55% 55/100, loss 1.5" in text
    assert text.count("stage main: rank 1 lost: a warm spare took over") == 1  # the recovery, once
    assert "campaign t is not running (running)" in text and "Traceback" not in text
    assert "campaign t — running" in out.read_text()  # then the status table


def test_status_watch_on_a_terminal_draws_a_bar_and_ctrl_c_ends_it_quietly(ledger):
    runner = holder()
    try:
        root = running_campaign(ledger, runner.pid)
        terminal = Terminal()
        proc = subprocess.Popen(
            watch_cmd(root),
            stdin=terminal.child,
            stdout=terminal.child,
            stderr=terminal.child,
            start_new_session=True,
            env={**os.environ, "COLUMNS": "200"},
        )
        terminal.opened()
        wait_for(lambda: "20/100" in terminal.text() and "━" in terminal.text(), 60, "the bar")
        ledger.set_stage_status("main", StageStatus.RUNNING)  # unchanged status: still running
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0
        terminal.close()
        text = terminal.text()
    finally:
        runner.kill()
        runner.wait()
    assert "training: stage main" in text and "loss 3" in text and "ETA 0:01:20" in text
    assert "stopped watching; the campaign goes on" in text and "Traceback" not in text


def test_model_saving_is_quiet_about_what_a_user_cannot_act_on_and_puts_logging_back(capsys):
    import logging

    from transformers.utils import logging as hf_logging

    from pretrain.checkpoints.registry import QUIET_LOGGERS, quiet_model_saving

    before = [logging.getLogger(n).level for n in QUIET_LOGGERS]
    with quiet_model_saving():
        logging.getLogger("mlflow.transformers").warning("Unable to find license information for this model")
        assert not hf_logging.is_progress_bar_enabled()
        logging.getLogger("mlflow.transformers").error("a real error still shows")
    assert "license" not in capsys.readouterr().err
    assert [logging.getLogger(n).level for n in QUIET_LOGGERS] == before and hf_logging.is_progress_bar_enabled()
