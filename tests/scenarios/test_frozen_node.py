"""A node that freezes (every process of it stopped, sockets open, nothing exits): the rendezvous
drops it once its keep-alives lapse and the other node trains on; the orchestrator, which knows
nodes only as processes, stops it once its agent's liveness file went silent, instead of waiting
for its exit for ever."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil

from pretrain.cluster.local import LocalJobHandle
from support.campaigns import kept_trajectory, run_to_completion, small_spec, wait_for
from trainer.common.process import pid_alive
from trainer.job.reporting import read_all
from trainer.liveness import NodeLiveness, liveness_path, silent_for
from trainer.resilience.heartbeat import heartbeat_dir

AGENT = """
import sys, threading
from trainer.liveness import NodeLiveness
NodeLiveness(sys.argv[1], int(sys.argv[2]), interval_s=0.1).start()
print("alive", flush=True)
threading.Event().wait()
"""


def start_agent(job_dir, node: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(job_dir), str(node)], stdout=subprocess.PIPE, start_new_session=True
    )
    assert proc.stdout.readline() == b"alive\n"
    return proc


def test_the_local_handle_stops_a_silent_node_and_only_that_one(tmp_path):
    procs = [start_agent(tmp_path, n) for n in (0, 1)]
    handle = LocalJobHandle(procs, nodes=[0, 1], job_dir=tmp_path, silent_after_s=1.0)
    try:
        os.killpg(procs[1].pid, signal.SIGSTOP)  # node 1 freezes; node 0 keeps beating
        lost = wait_for(lambda: handle.lost_nodes(), 10, "the frozen node counted lost")
        assert lost == {1: -signal.SIGKILL} and procs[0].poll() is None
        notices = handle.new_notices()
        assert len(notices) == 1 and "node 1 gave no sign of life" in notices[0], notices
        assert handle.new_notices() == [] and handle.poll() is None  # node 0 still runs: the job goes on
        assert silent_for(tmp_path, 0, procs[0].pid) < 1.0
    finally:
        handle.stop(grace_s=1)


def test_a_node_still_running_after_the_job_ended_elsewhere_is_stopped_once_it_misses_a_few_beats(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True), start_agent(tmp_path, 1)]
    handle = LocalJobHandle(procs, nodes=[0, 1], job_dir=tmp_path, silent_after_s=600)
    try:
        procs[0].wait()  # node 0 finished the job
        os.killpg(procs[1].pid, signal.SIGSTOP)
        wait_for(lambda: handle.poll() is not None, 20, "the job's end")
        assert handle.poll() == 0 and handle.lost_nodes() == {1: -signal.SIGKILL}
    finally:
        handle.stop(grace_s=1)


def test_a_liveness_file_that_cannot_be_written_does_not_stop_the_node(tmp_path, capsys):
    (tmp_path / "job").write_text("not a directory")
    NodeLiveness(tmp_path / "job", 0).start().stop()
    assert "no liveness file" in capsys.readouterr().err
    assert silent_for(tmp_path / "job", 0, pid=None) is None


def test_a_liveness_file_of_another_process_or_damaged_is_never_taken_for_silence(tmp_path):
    path = liveness_path(tmp_path, 0)
    path.parent.mkdir(parents=True)
    old = time.time() - 3600
    for text in (json.dumps({"pid": 12345}), "{trunc", json.dumps([1, 2])):
        path.write_text(text)
        os.utime(path, (old, old))
        assert silent_for(tmp_path, 0, pid=os.getpid()) is None, text
    path.write_text(json.dumps({"pid": os.getpid()}))
    os.utime(path, (old, old))
    assert silent_for(tmp_path, 0, pid=os.getpid()) > 3000
    assert silent_for(tmp_path, 1, pid=os.getpid()) is None  # no file yet: a node still starting


def test_a_frozen_node_is_dropped_then_stopped_and_the_stage_completes(
    prefect_harness, prepared_data, tmp_path, monkeypatch
):
    monkeypatch.setenv("PRETRAIN_NODE_SILENT_S", "8")
    spec = small_spec(
        tmp_path,
        cluster={
            "workers_per_node": 1,
            "nodes_min": 1,
            "nodes_max": 2,
            "max_restarts": 3,
            "rejoin_after_s": 0,
            "node_timeout_s": 2,
        },
        stages=[{"name": "main", "steps": 30, "seq_len": 32, "micro_batch": 2, "warmup_steps": 3}],
        checkpoint={"interval": 4, "memory_interval": 2, "keep": 3},
        chaos=[{"kind": "freeze_node", "node": 1, "step": 10}],
    )
    stage = run_to_completion(spec, prepared_data, attempts=1)
    failure = stage["failures"][0]
    assert failure["cause"] == "node_lost" and failure["recovery_path"] == "restart", failure

    job_dir = spec.workdir_path / "jobs" / "main" / "attempt_000"
    metrics = read_all(job_dir / "metrics.jsonl")
    assert kept_trajectory(metrics, 30, global_batch=4)[30]["world_size"] == 1
    events = read_all(job_dir / "events.jsonl")
    # the survivor went on as soon as the rendezvous dropped the frozen node (its process is stopped 8 s
    # after its last sign of life, or once the job ended on the other node)
    dropped = [e["time"] for e in events if e["event"] == "node_lost" and e["source"] == "rendezvous"]
    again = [e["time"] for e in events if e["event"] == "start" and e.get("restart_count") == 1]
    assert len(dropped) == 1 and again and dropped[0] < again[0] < dropped[0] + 5, (dropped, again)
    # found when the rendezvous dropped it (its keep-alives lapsed), not when it froze
    frozen_at = next(e["time"] for e in events if e["event"] == "chaos" and e["kind"] == "freeze_node")
    assert failure["detected_at"] == dropped[0] and failure["detection_s"] == round(dropped[0] - frozen_at, 2) > 0
    # nothing of the frozen node is left stopped behind: its agent and its worker are gone
    agent = json.loads(liveness_path(job_dir, 1).read_text())["pid"]
    workers = [json.loads(p.read_text())["pid"] for p in heartbeat_dir(job_dir).glob(f"agent{agent}-local*.json")]
    assert workers and not any(pid_alive(p) for p in [agent, *workers])
    wait_for(lambda: not of_job(job_dir), 30, "no process of the job left (the frozen node's saver)")


def of_job(job_dir) -> list[psutil.Process]:
    """The live processes whose command line names the job's directory (agents, workers, savers)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and str(job_dir) in " ".join(p.info["cmdline"] or ()):
            found.append(p)
    return found


def test_a_frozen_single_node_job_is_stopped_and_relaunched_from_its_last_checkpoint(
    prefect_harness, prepared_data, tmp_path, monkeypatch
):
    """A job of one node freezes: it is stopped once silent, its failure named a lost node, and the
    next attempt resumes from the newest good checkpoint."""
    monkeypatch.setenv("PRETRAIN_NODE_SILENT_S", "3")
    spec = small_spec(
        tmp_path,
        stages=[{"name": "main", "steps": 12, "seq_len": 32, "micro_batch": 2, "warmup_steps": 2}],
        checkpoint={"interval": 4, "memory_interval": 2, "keep": 3},
        chaos=[{"kind": "freeze_node", "node": 0, "step": 6}],
    )
    stage = run_to_completion(spec, prepared_data, attempts=2)
    [failure] = [f for f in stage["failures"] if not f.get("in_job")]
    assert failure["cause"] == "node_lost", failure  # not a worker failure, not a signal
    events = read_all(spec.workdir_path / "jobs" / "main" / "attempt_000" / "events.jsonl")
    [lost] = [e for e in events if e["event"] == "node_lost"]
    assert (lost["node"], lost["exit_code"], lost["silent_s"] >= 3) == (0, -signal.SIGKILL, True), lost
    assert stage["good_checkpoint"]["step"] == 12
