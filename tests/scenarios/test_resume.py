"""Fault injection with real processes: killed workers, failed jobs, a killed campaign process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import psutil
import pytest
import yaml
from mlflow.tracking import MlflowClient
from prefect.settings import PREFECT_API_URL

from flows.campaign import pretrain_campaign
from flows.train_stage import StageFailed
from pretrain.views.status import campaign_status
from support.campaigns import (
    assert_no_duplicate_metric_steps,
    campaign_events,
    run_campaign_while,
    seed_data,
    session_api_env,
    small_spec,
    wait_for,
    worker_processes,
)
from support.terminal import Terminal
from trainer.checkpoint import store as ckpt
from trainer.job.reporting import read_all

# steps of ~0.1 s, so a worker can be killed well inside the stage
SLOW_MODEL = {"n_layer": 4, "n_head": 4, "d_model": 128, "max_seq_len": 64}
ONE_STAGE = [{"name": "main", "steps": 40, "seq_len": 64, "micro_batch": 8, "warmup_steps": 5}]


def slow_spec(tmp_path, prepared_data, **overrides):
    spec = small_spec(
        tmp_path,
        model=SLOW_MODEL,
        stages=ONE_STAGE,
        checkpoint={"interval": 10, "memory_interval": 5, "keep": 5},
        **overrides,
    )
    seed_data(spec, prepared_data)
    return spec


def ckpt_dir(spec):
    return spec.workdir_path / "checkpoints" / "main"


def assert_mlflow_steps_unique(spec, expected_parent_runs=1):
    client = MlflowClient(spec.tracking_uri)
    exp = client.get_experiment_by_name(spec.tracking.experiment)
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags["pretrain.role"] == "campaign"]
    assert len(parents) == expected_parent_runs
    assert_no_duplicate_metric_steps(spec.tracking_uri)
    return client, runs


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_all_exit(procs: list[psutil.Process], timeout: float = 30) -> None:
    """Every one of ``procs`` exits within ``timeout`` (the stragglers are killed, then the test fails)."""
    try:
        wait_for(lambda: not [p for p in procs if alive(p)], timeout, "every process the CLI started to exit")
    finally:
        for p in procs:
            if alive(p):
                p.kill()


def kill_a_worker_after_first_checkpoint(spec) -> int:
    wait_for(lambda: ckpt.CheckpointStore.open(ckpt_dir(spec)).read_pointer(), 120, "the first checkpoint")
    victim = wait_for(lambda: worker_processes(spec.workdir_path), 30, "a training worker")[-1]
    step_at_kill = ckpt.CheckpointStore.open(ckpt_dir(spec)).read_pointer()
    os.kill(victim.pid, signal.SIGKILL)
    return step_at_kill


@pytest.mark.slow  # the job-level one: test_fast_recovery::test_a_fast_recovery_that_cannot_finish_in_time_falls_…
def test_worker_sigkill_is_survived_by_an_in_job_restart(prefect_harness, prepared_data, tmp_path):
    """The full restart (the fast path, which keeps the other worker, is off here:
    tests/scenarios/test_fast_recovery.py)."""
    spec = slow_spec(tmp_path, prepared_data, fault_tolerance={"fast_recovery_timeout_s": 0})
    status, killed_at = run_campaign_while(spec, lambda: kill_a_worker_after_first_checkpoint(spec))
    stage = status["stages"][0]
    assert status["status"] == "completed" and stage["steps_done"] == 40
    restarts = [r for r in stage["resumes"] if r["restart_count"] > 0]
    assert restarts and restarts[0]["source"] == "memory" and restarts[0]["step"] >= killed_at > 0
    assert stage["restarts"] >= 1 and stage["attempts"] == 1
    client, runs = assert_mlflow_steps_unique(spec)
    stage_run = next(r for r in runs if r.data.tags["pretrain.role"] == "stage")
    assert sorted(m.step for m in client.get_metric_history(stage_run.info.run_id, "loss")) == list(range(1, 41))
    assert not worker_processes(spec.workdir_path)
    restarted = wait_for(
        lambda: [
            e
            for e in campaign_events(PREFECT_API_URL.value(), spec.name)
            if e["event"] == "pretrain.stage.restarted" and e["resource"]["pretrain.workdir"] == str(spec.workdir_path)
        ],
        30,
        "the restart event",
    )
    assert restarted[0]["payload"]["in_job"] is True and restarted[0]["payload"]["source"] == "memory"


def test_failed_job_is_relaunched_from_the_last_checkpoint(prefect_harness, prepared_data, tmp_path):
    spec = slow_spec(tmp_path, prepared_data, cluster={"workers_per_node": 2, "max_restarts": 0})
    status, killed_at = run_campaign_while(spec, lambda: kill_a_worker_after_first_checkpoint(spec))
    stage = status["stages"][0]
    assert status["status"] == "completed" and stage["attempts"] == 2
    assert len(stage["failures"]) == 1 and stage["failures"][0]["cause"].startswith("worker_failure")
    relaunch = stage["failures"][0]  # the relaunch (new job, rendezvous, restore) is time lost, not 0.1 s
    assert relaunch["recovery_s"] > 0 and relaunch["time_lost_s"] >= relaunch["recovery_s"]
    second = [r for r in stage["resumes"] if r["attempt"] == 1]
    assert second[0]["source"] == "checkpoint" and second[0]["step"] >= killed_at
    assert_mlflow_steps_unique(spec)


def test_stage_fails_clearly_after_max_attempts(prefect_harness, prepared_data, tmp_path):
    # windows of 60001 tokens do not fit the validation-sized data: every launch fails in start-up
    # (one worker and no memory snapshots, so no saver: each launch starts two processes, not four)
    spec = small_spec(
        tmp_path,
        model={"n_layer": 1, "n_head": 1, "d_model": 8, "max_seq_len": 65536},
        stages=[{"name": "main", "steps": 5, "seq_len": 60000}],
        cluster={"workers_per_node": 1, "max_restarts": 0},
        checkpoint={"interval": 4, "memory_interval": 0, "keep": 2},
    )
    seed_data(spec, prepared_data)
    with pytest.raises(StageFailed, match=r"stage main stopped at step 0/5 after 2 attempt\(s\).*DataError"):
        pretrain_campaign(spec=spec)
    status = campaign_status(spec.workdir_path)
    assert status["status"] == "failed" and status["stages"][0]["attempts"] == 2
    assert "no window of 60001 tokens" in " ".join(status["stages"][0]["failures"][0]["errors"])
    client, runs = assert_mlflow_steps_unique(spec)
    assert {r.info.status for r in runs} == {"FAILED"}
    assert all("stage main stopped at step 0/5" in r.data.tags["pretrain.end_cause"] for r in runs)  # the failure hook

    def stage_events():  # the stage's relaunch and its final failure, as Prefect events of this campaign
        found = {
            e["event"]: e
            for e in campaign_events(PREFECT_API_URL.value(), spec.name)
            if e["resource"]["pretrain.workdir"] == str(spec.workdir_path)
        }
        return found if {"pretrain.stage.restarted", "pretrain.stage.failed"} <= set(found) else None

    found = wait_for(stage_events, 30, "the stage events", interval=0.5)
    assert found["pretrain.stage.restarted"]["payload"] == {
        "stage": "main",
        "attempt": 1,
        "in_job": False,
        "from_step": None,
    }
    assert found["pretrain.stage.failed"]["payload"]["cause"] == "data"


def test_a_campaign_that_fails_for_good_says_why_without_a_traceback(prefect_harness, prepared_data, tmp_path):
    """`pretrain run` of a stage that cannot start (windows longer than the data): the user reads
    what failed, where its logs are and what to do; Prefect's tracebacks stay in the run's logs.
    (It talks to the session's Prefect API, as with a configured server: the CLI's own server is
    the next test's.)"""
    spec = small_spec(
        tmp_path / "wd",
        model={"n_layer": 1, "n_head": 1, "d_model": 8, "max_seq_len": 65536},
        stages=[{"name": "main", "steps": 5, "seq_len": 60000}],
        resume={"max_attempts": 1},
        cluster={"workers_per_node": 1, "max_restarts": 0},
        checkpoint={"interval": 4, "memory_interval": 0, "keep": 2},
    )
    seed_data(spec, prepared_data)
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))

    proc = subprocess.run(
        [sys.executable, "-m", "pretrain.cli.app", "run", str(spec_file)],
        capture_output=True,
        text=True,
        timeout=300,
        env=session_api_env(PREFECT_SERVER_ANALYTICS_ENABLED="false"),
    )

    shown = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in shown, shown[-4000:]
    assert "campaign failed: stage main stopped at step 0/5 after 1 attempt(s)" in proc.stderr, proc.stderr[-3000:]
    assert "no window of 60001 tokens" in shown and "run the same command again" in proc.stderr.lower()
    assert "local Prefect API server" not in shown  # the configured one serves


def test_killed_campaign_process_resumes_when_run_again(prefect_harness, prepared_data, tmp_path):
    """The real CLI on a terminal (it shows the live training bar), with its own Prefect API server,
    killed with SIGKILL after the first checkpoint, its ``latest`` pointer replaced by a directory,
    then the same command again (on the session's Prefect API: a server of its own costs seconds of
    CPU, and the first run's is what this test is about). Its MLflow store is new, as a first
    campaign's is."""
    spec = slow_spec(
        tmp_path / "wd",
        prepared_data,
        tracking={"register_model": False, "uri": f"sqlite:///{tmp_path / 'new-store.db'}"},
    )
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    cmd = [sys.executable, "-m", "pretrain.cli.app", "run", str(spec_file), "--workdir", str(spec.workdir_path)]
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    terminal = Terminal()  # the first run on a terminal: it draws the live training bar
    first = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=terminal.child, stderr=terminal.child, env={**env, "COLUMNS": "200"}
    )
    terminal.opened()
    try:
        wait_for(lambda: ckpt.CheckpointStore.open(ckpt_dir(spec)).read_pointer(), 180, "the first checkpoint")
        started = psutil.Process(first.pid).children(recursive=True)  # agents, workers, savers, the Prefect API server
        try:
            wait_for(
                lambda: re.search(r"training: stage main .*━.* \d+/40, loss", terminal.text()),
                60,
                "the live training bar",
            )
        except BaseException:
            print("the terminal showed:", terminal.text()[-3000:])
            raise
    finally:
        first.kill()
        first.wait()
        terminal.close()
    assert "Traceback" not in terminal.text()
    assert "starting a local Prefect API server for this run" in terminal.text()  # the first seconds say why
    assert "Beginning flow run" in terminal.text() and "View at" not in terminal.text()  # that server has no UI to link
    assert "Creating initial MLflow database tables" not in terminal.text()  # MLflow's bookkeeping, not shown
    assert (tmp_path / "new-store.db").is_file()
    killed_at = ckpt.CheckpointStore.open(ckpt_dir(spec)).read_pointer()
    assert 0 < killed_at < 40
    # nothing the killed CLI started outlives it: each process notices its parent is gone and stops
    assert_all_exit(started)
    pointer = ckpt_dir(spec) / ckpt.POINTER  # and its pointer is a mess: a directory where the file was
    pointer.unlink()
    pointer.mkdir()
    second = subprocess.run(
        cmd, capture_output=True, text=True, env=session_api_env(PREFECT_SERVER_ANALYTICS_ENABLED="false"), timeout=300
    )
    assert second.returncode == 0, second.stderr[-3000:]
    status = campaign_status(spec.workdir_path)
    stage = status["stages"][0]
    assert status["status"] == "completed" and status["invocations"] == 2 and stage["steps_done"] == 40
    starts = [r for r in stage["resumes"] if r["attempt"] == 1]
    assert starts[0]["source"] == "checkpoint" and starts[0]["step"] >= killed_at
    first_job = read_all(spec.workdir_path / "jobs" / "main" / "attempt_001" / "events.jsonl")
    assert min(e["step"] for e in first_job if e["event"] == "start") > 0  # never from step 0
    assert ckpt.CheckpointStore.open(ckpt_dir(spec)).pointer_problems() == []  # written anew,
    assert list(ckpt_dir(spec).glob(f"{ckpt.POINTER}.not-a-file-*"))  # the directory moved aside
    assert_mlflow_steps_unique(spec)
