"""Ctrl-C and SIGTERM stop a campaign: the real CLI in its own process group, signalled as a
terminal (or a process manager) does, then the same command resumes it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml
from mlflow.tracking import MlflowClient
from test_resume import SLOW_MODEL, assert_all_exit, assert_mlflow_steps_unique, ckpt_dir

from pretrain.run.stop import CampaignInterrupted, current_stop, stop_on_signals
from pretrain.views.status import campaign_status
from support.campaigns import seed_data, session_api_env, small_spec, wait_for
from trainer.checkpoint import store as ckpt
from trainer.job.reporting import read_all

# Ctrl-C goes out at the first checkpoint (step 10) and reaches every process of the group at once:
# 30 steps later is well before the stage's end, even on a loaded machine (as for test_resume's
# killed CLI, whose stage is as long); the resumed run trains what is left, so no longer than that
STEPS = 40
# SIGTERM reaches the CLI alone, which then stops the job: more margin, and nothing resumes it
SIGTERM_STEPS = 80


def test_first_signal_asks_to_stop_a_second_kills_at_once():
    """Real signals to this process: the handlers only record; a job's kill runs on the second."""
    killed, before = [], signal.getsignal(signal.SIGTERM)
    with stop_on_signals() as stop:
        assert current_stop() is stop
        stop.raise_if_requested("never")  # nothing asked yet
        forget = stop.kill_at_once(lambda: killed.append("job"))
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(stop.requested.is_set, 5, "the first signal")
        assert (stop.name, stop.urgent.is_set(), killed) == ("SIGTERM", False, [])
        try:
            stop.raise_if_requested("before stage main")
        except CampaignInterrupted as e:
            assert (str(e), e.exit_code) == ("campaign interrupted by SIGTERM before stage main", 143)
        else:
            raise AssertionError("no CampaignInterrupted")
        os.kill(os.getpid(), signal.SIGINT)
        wait_for(stop.urgent.is_set, 5, "the second signal")
        stop.kill_now()
        forget()
        stop.kill_now()  # a job that ended is not killed again
        assert killed == ["job"] and stop.signum == signal.SIGTERM  # the first signal names the stop
        assert [stop.record_once(lambda: None) for _ in range(2)] == [True, False]
    assert current_stop() is None and signal.getsignal(signal.SIGTERM) is before


def test_a_signal_ignored_at_start_stays_ignored():
    """A background job started with SIGINT ignored is not stopped by a Ctrl-C meant for others."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with stop_on_signals() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            wait_for(stop.requested.is_set, 5, "SIGTERM")
            assert stop.name == "SIGTERM" and stop.count == 1
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


class Cli:
    """``pretrain run`` in a session of its own with SIGINT at its default (a terminal's foreground
    job; a background child would inherit SIGINT ignored), output to files. It talks to the test
    session's Prefect API (the harness's, as a user's configured ``PREFECT_API_URL``): starting a
    server of its own, what test_resume's killed CLI keeps testing, costs seconds of CPU a run."""

    def __init__(self, tmp_path: Path, spec, name: str):
        spec_file = tmp_path / "spec.yaml"
        spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
        self.cmd = [
            sys.executable,
            "-m",
            "pretrain.cli.app",
            "run",
            str(spec_file),
            "--workdir",
            str(spec.workdir_path),
        ]
        self.env = session_api_env(PREFECT_SERVER_ANALYTICS_ENABLED="false")
        self.out, self.err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )

    def tree(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def output(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"pretrain run did not stop within {timeout}s:\n{self.output()[-3000:]}") from None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def start_training(tmp_path: Path, prepared_data, name: str, steps: int = STEPS, **overrides):
    spec = small_spec(
        tmp_path / "wd",
        model=SLOW_MODEL,
        checkpoint={"interval": 10, "memory_interval": 5, "keep": 5},
        stages=[{"name": "main", "steps": steps, "seq_len": 64, "micro_batch": 8, "warmup_steps": 5}],
        **overrides,
    )
    seed_data(spec, prepared_data)
    cli = Cli(tmp_path, spec, name)
    try:
        wait_for(
            lambda: ckpt.CheckpointStore.open(ckpt_dir(spec)).read_pointer() or cli.proc.poll() is not None,
            240,
            "the first checkpoint",
        )
        assert cli.proc.poll() is None, cli.output()[-3000:]
    except BaseException:
        cli.kill()
        raise
    return spec, cli


def assert_recorded_interrupted(spec, cause: str):
    status = campaign_status(spec.workdir_path)
    assert status["status"] == "interrupted"
    assert status["stages"][0]["status"] == "interrupted"
    assert status["stages"][0]["failures"] == []  # an operator's stop is no failure of the job
    ledger = json.loads((spec.workdir_path / "ledger.json").read_text())
    assert ledger["end"]["state"] == "interrupted" and cause in ledger["end"]["cause"]
    client = MlflowClient(spec.tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name(spec.tracking.experiment).experiment_id])
    assert {r.info.status for r in runs} == {"KILLED"}
    assert {r.data.tags["pretrain.end_state"] for r in runs} == {"interrupted"}
    return status


def assert_recorded_paused(spec, cause: str):
    """Paused cleanly: the final save committed and judged good, no failure, the MLflow runs
    scheduled (the next run goes on with them)."""
    status = campaign_status(spec.workdir_path)
    [stage] = status["stages"]
    assert (status["status"], stage["status"], stage["failures"]) == ("paused", "paused", [])
    end = json.loads((spec.workdir_path / "ledger.json").read_text())["end"]
    assert end["state"] == "paused" and f"{cause} received" in end["cause"]
    assert end["step"] == stage["good_checkpoint"]["step"] == stage["latest_checkpoint"]["step"]
    client = MlflowClient(spec.tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name(spec.tracking.experiment).experiment_id])
    assert {(r.info.status, r.data.tags["pretrain.end_state"]) for r in runs} == {("SCHEDULED", "paused")}
    return status


def test_ctrl_c_pauses_the_campaign_and_the_same_command_resumes_it(prefect_harness, prepared_data, tmp_path):
    spec, cli = start_training(tmp_path, prepared_data, "first")
    # piped, `pretrain run` says how training goes: a progress line once the stage trains
    wait_for(lambda: "training: stage main" in cli.output(), 60, "a training progress line")
    tree = cli.tree()
    at_signal = ckpt.CheckpointStore.open(ckpt_dir(spec)).read_pointer()
    os.killpg(cli.proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C: the whole foreground group
    code = cli.wait(180)
    output = cli.output()
    assert code == 130, output[-3000:]
    assert "Traceback" not in output, output[-5000:]
    assert "paused: campaign paused at main step" in " ".join(output.split())
    assert "Run the same command to resume" in output
    assert f"pretrain run {tmp_path / 'spec.yaml'} --workdir {spec.workdir_path}" in output
    status = assert_recorded_paused(spec, "SIGINT")
    assert at_signal <= status["stages"][0]["latest_checkpoint"]["step"] < STEPS
    events = read_all(spec.workdir_path / "jobs" / "main" / "attempt_000" / "events.jsonl")
    saved = max(e["step"] for e in events if e["event"] == "checkpoint")
    assert (
        saved == ckpt.CheckpointStore.open(ckpt_dir(spec)).read_pointer()
    )  # the savers' final save committed (at breakpoint)
    assert_all_exit(tree)

    second = subprocess.run(cli.cmd, capture_output=True, text=True, env=cli.env, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    status = campaign_status(spec.workdir_path)
    stage = status["stages"][0]
    assert status["status"] == "completed" and status["invocations"] == 2 and stage["steps_done"] == STEPS
    resumed = [r for r in stage["resumes"] if r["attempt"] == 1]
    assert resumed[0]["source"] == "checkpoint" and resumed[0]["step"] == saved
    assert_mlflow_steps_unique(spec)


def test_sigterm_stops_the_campaign_and_a_second_signal_stops_it_at_once(prefect_harness, prepared_data, tmp_path):
    spec, cli = start_training(tmp_path, prepared_data, "first", SIGTERM_STEPS)
    tree = cli.tree()
    os.kill(cli.proc.pid, signal.SIGTERM)  # a process manager stops the CLI alone
    wait_for(lambda: "stopping" in cli.err.read_text(), 30, "the CLI to acknowledge the signal")
    os.kill(cli.proc.pid, signal.SIGTERM)  # impatient: stop now
    code = cli.wait(60)
    output = cli.output()
    assert code == 143, output[-3000:]
    assert "Traceback" not in output, output[-5000:]
    assert "Run the same command to resume" in output
    assert_recorded_interrupted(spec, "SIGTERM")
    assert_mlflow_steps_unique(spec)
    assert_all_exit(tree)
    store = ckpt_dir(spec)
    for step in ckpt.CheckpointStore.open(store).committed_steps():  # nothing torn: every committed checkpoint verifies
        assert ckpt.CheckpointStore.open(store).verify(step) == []


@pytest.mark.slow  # in process: test_sigterm_pause::test_a_pause_that_outlasts_its_window_stops_at_once
def test_sigterm_stops_everything_at_once_when_the_pause_outlasts_the_grace_period(
    prefect_harness, prepared_data, tmp_path
):
    """A pause that cannot be done within ``resume.grace_period_s`` (1 s here; the node's saver is
    frozen, so the job's final save never ends) is cut short: the job killed, the campaign recorded
    interrupted saying so, nothing torn; the next run resumes from the last good checkpoint."""
    spec, cli = start_training(tmp_path, prepared_data, "first", resume={"max_attempts": 2, "grace_period_s": 1})
    tree = cli.tree()
    [saver] = [p for p in tree if "trainer.saver" in " ".join(p.cmdline())]
    saver.suspend()
    try:
        os.kill(cli.proc.pid, signal.SIGTERM)
        code = cli.wait(60)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            saver.resume()  # the SIGTERM its zygote sent it meanwhile ends it now
    output = cli.output()
    assert code == 143, output[-3000:]
    assert "Traceback" not in output, output[-5000:]
    assert "did not pause within resume.grace_period_s (1s)" in " ".join(output.split())
    assert_recorded_interrupted(spec, "stopped at once when resume.grace_period_s (1s) ran out")
    assert_all_exit(tree)
    store = ckpt_dir(spec)
    for step in ckpt.CheckpointStore.open(store).committed_steps():  # nothing torn: every committed checkpoint verifies
        assert ckpt.CheckpointStore.open(store).verify(step) == []
