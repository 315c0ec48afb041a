"""Hangs found in seconds: the step timeout adapts to the job's observed step durations (the
spec's ``step_timeout_s`` an upper bound), and a hang is recorded as ``hang`` at the time it
was found."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain.run.incidents import incidents
from pretrain.run.jobs import build_job
from support.agents import run_agent
from support.campaigns import seed_data, small_spec, wait_for
from trainer.job.reporting import EVENTS, METRICS, read_all
from trainer.resilience.heartbeat import (
    AdaptiveTimeout,
    HangDetector,
    Heartbeat,
    collective_timeout_s,
    heartbeat_dir,
    p99,
)
from trainer.resilience.stacks import dump_on_signal, stack_path, take_dump, where

RULE = AdaptiveTimeout(factor=5.0, floor_s=2.0, warmup=10)

LIMITS = {  # name: (rule, upper bound, durations observed, their p99) → timeout
    "warm-up: the spec's bound": (RULE, 300.0, 9, 0.05, 300.0),
    "fast steps: the floor": (RULE, 300.0, 10, 0.05, 2.0),
    "slow steps: k × p99": (RULE, 300.0, 50, 4.0, 20.0),
    "never above the spec's bound": (RULE, 10.0, 50, 4.0, 10.0),
    "a bound below the floor wins": (RULE, 1.0, 50, 0.05, 1.0),
    "factor 0: fixed timeouts": (AdaptiveTimeout(0.0, 2.0, 10), 300.0, 50, 0.05, 300.0),
}


@pytest.mark.parametrize("case", list(LIMITS))
def test_adapted_timeout(case):
    rule, upper, observed, p99_s, expected = LIMITS[case]
    assert rule.limit(upper, observed, p99_s) == pytest.approx(expected)


@pytest.mark.parametrize(
    "values, expected", [([1.0], 1.0), ([3.0, 1.0, 2.0], 3.0), (list(range(1, 101)), 99), (list(range(1, 201)), 198)]
)
def test_p99_is_the_nearest_rank(values, expected):
    assert p99(values) == expected


@pytest.mark.parametrize(
    "timeouts, expected",
    [({"startup": 600, "step": 300, "checkpoint": 600}, 660), ({"startup": 60, "step": 900, "checkpoint": 60}, 960)],
)
def test_the_process_group_outwaits_every_hang_timeout(timeouts, expected):
    """A stalled collective must be found by the hang detector (a ``hang``), not end first by the
    group's own timeout (an anonymous worker failure, as with step_timeout_s above 300 before)."""
    assert collective_timeout_s(timeouts) == expected


def test_heartbeat_reports_its_recent_step_durations(tmp_path):
    beat = Heartbeat(tmp_path, 0, 0)
    beat.beat("startup", 0)
    for step in range(3):
        beat.beat("step", step)
        beat.beat("checkpoint", step + 1)
    beat.beat("step", 3)
    beat.flush()
    record = json.loads(beat.path.read_text())
    assert record["phase"] == "step" and record["step"] == 3
    count, slowest = record["observed"]["step"]
    assert count == 3 and slowest >= 0  # steps only; startup and checkpoint phases are not counted
    assert set(record["observed"]) == {"step"}


def test_a_heartbeat_file_is_there_at_the_first_beat_and_follows_the_newest_one(tmp_path):
    """The agent finds a worker by its file as soon as it beats once; later beats reach the file
    from the writer thread (a beat itself writes nothing), the newest one last."""
    beat = Heartbeat(tmp_path, 0, 0)
    beat.beat("startup", 0)
    assert json.loads(beat.path.read_text())["phase"] == "startup"
    for step in range(50):
        beat.beat("step", step)
        beat.beat("checkpoint", step + 1)
    wait_for(lambda: json.loads(beat.path.read_text())["step"] == 50, 30, "the newest beat in the file")
    assert json.loads(beat.path.read_text())["phase"] == "checkpoint"


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    yield proc
    proc.kill()
    proc.wait()


WORKERS = {  # name: the heartbeat's age (s), what it reports → found hung (and killed)
    "after warm-up, stalled past the floor": (3.0, {"observed": {"step": [20, 0.01]}}, True),
    "during warm-up: the spec's bound": (3.0, {"observed": {"step": [5, 0.01]}}, False),
    "a record of the release before (no durations)": (3.0, {}, False),
    "a damaged durations entry": (3.0, {"observed": {"step": "x"}}, False),
    "after warm-up, within the floor": (0.5, {"observed": {"step": [20, 0.01]}}, False),
}


@pytest.mark.parametrize("case", list(WORKERS))
def test_detector_judges_each_worker_by_its_own_durations(case, tmp_path, sleeper):
    age, fields, hung = WORKERS[case]
    d = heartbeat_dir(tmp_path)
    d.mkdir()
    (d / f"agent{os.getpid()}-local0.json").write_text(
        json.dumps({"phase": "step", "step": 30, "rank": 0, "pid": sleeper.pid, "time": time.time() - age, **fields})
    )
    found = []
    HangDetector(tmp_path, {"step": 300.0}, found.append, adaptive=RULE).scan()
    assert bool(found) == hung
    if hung:
        assert found[0]["timeout_s"] == 2.0 and found[0]["ranks"] == [0]
        assert sleeper.wait(30) == -9  # the hung worker is killed
    else:
        assert sleeper.poll() is None


def test_a_hang_is_found_well_before_step_timeout_and_recorded_as_hang(prepared_data, tmp_path, zygote):
    """A worker hangs at step 6 of a job whose ``step_timeout_s`` is 120: the agent finds it
    after the adapted timeout (seconds), the job recovers and completes, and the incident says
    ``hang``, detected when the detector found it (not when the worker stopped)."""
    spec = small_spec(
        tmp_path,
        cluster={"workers_per_node": 1, "max_restarts": 1},
        stages=[{"name": "s", "steps": 8, "seq_len": 32, "micro_batch": 2}],
        checkpoint={"interval": 4, "memory_interval": 1, "keep": 2},
        chaos=[{"kind": "hang_worker", "step": 6, "rank": 0}],
        fault_tolerance={"step_timeout_s": 120, "hang_warmup_steps": 3},
    )  # default factor and floor
    seed_data(spec, prepared_data)
    job = build_job(spec, 0, 0, None)
    assert run_agent(job, timeout=300, max_restarts=1, zygote=zygote) == 0
    events, metrics = read_all(Path(job.job_dir) / EVENTS), read_all(Path(job.job_dir) / METRICS)
    [hang] = [e for e in events if e["event"] == "hang"]
    [drill] = [e for e in events if e["event"] == "chaos"]
    assert hang["timeout_s"] < 120 and hang["stalled_s"] < 60  # found in seconds, not after step_timeout_s
    [incident] = incidents(events, metrics, 0)
    assert incident["cause"] == "hang"
    assert incident["detected_at"] == hang["time"] > drill["time"]
    assert max(m["step"] for m in metrics) == 8
    # where it hung: the drill's wait, in the chaos module's code; every thread's stack kept
    [stack] = incident["stacks"]
    assert stack["rank"] == 0 and stack["where"].startswith("wait (threading.py:"), stack
    assert " from before_step (trainer/resilience/chaos.py:" in stack["where"], stack
    dump = (Path(job.job_dir) / stack["file"]).read_text()
    assert "Current thread" in dump or "Thread 0x" in dump
    assert dump.count("Thread 0x") >= 2  # every thread (its heartbeat writer, its orphan watch), not only the hung one


def test_a_worker_blocked_in_a_c_call_says_where_it_is_and_goes_on(tmp_path):
    """``kill -USR1`` (what the hang detector sends before it kills a hung worker) makes a worker
    write every thread's stack even while its main thread is blocked in a C call; it is not
    stopped by it."""
    path = stack_path(tmp_path / "agent1-local0.json")
    code = f"""if True:
        import os, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from pathlib import Path
        from trainer.resilience.stacks import dump_on_signal
        dump_on_signal(Path({str(path)!r}))
        def read_a_pipe_nobody_writes():
            r, w = os.pipe()
            print("ready", flush=True)
            os.read(r, 1)
        read_a_pipe_nobody_writes()
    """
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        blocked = f"read_a_pipe_nobody_writes (<string>:{code.splitlines().index('            os.read(r, 1)') + 1})"
        # (the first dump may still find it in print(), right after "ready": until one finds it in the read)
        wait_for(lambda: where(take_dump(proc.pid, path)) == blocked, 30, "a dump of the process blocked in its read")
        assert proc.poll() is None
        assert where(take_dump(proc.pid, path)) == blocked  # again: the file holds the newest dump only
    finally:
        proc.kill()
        proc.wait()


DUMPS = {  # name: a faulthandler dump → where
    "the main thread is not the current one": (
        'Thread 0x1 (most recent call first):\n  File "/x/site-packages/torch/a.py", line 3 in wait\n'
        '  File "/usr/lib/threading.py", line 9 in _bootstrap\n\n'
        'Current thread 0x2 (most recent call first):\n  File "/x/site-packages/torch/distributed/c10d.py", line 7 in '
        f'all_reduce\n  File "{Path(__file__).resolve().parents[2]}/trainer/loop.py", line 5 in step\n'
        '  File "<frozen runpy>", line 88 in _run_code\n  File "<string>", line 1 in <module>\n',
        "all_reduce (torch/distributed/c10d.py:7) from step (trainer/loop.py:5)",
    ),
    "the innermost frame is ours": (
        f'Current thread 0x2 (most recent call first):\n  File "{Path(__file__).resolve().parents[2]}/trainer/x.py", '
        'line 2 in f\n  File "m.py", line 1 in <module>\n',
        "f (trainer/x.py:2)",
    ),
    "no frame (a dump cut short)": ("Current thread 0x2 (most recent call first):\n", None),
    "not a dump": ("garbage\n", None),
}


@pytest.mark.parametrize("case", list(DUMPS))
def test_where_names_the_main_threads_innermost_frame_and_our_code(case):
    text, expected = DUMPS[case]
    assert where(text) == expected


@pytest.fixture
def sleepers():
    procs = [subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"]) for _ in range(2)]
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


WHO_HANGS = {  # name: per rank (heartbeat age s, waiting in a collective), grace for remote peers s → killed, kept
    "one hung, the other waits for it in a collective": ([(10.0, False), (10.0, True)], 0.0, [0], [1]),
    "one hung, the other still within its timeout": ([(10.0, False), (0.1, True)], 0.0, [0], [1]),
    "both wait in a collective: the collective hangs": ([(10.0, True), (10.0, True)], 0.0, [0, 1], []),
    "both hung outside collectives": ([(10.0, False), (10.0, False)], 0.0, [0, 1], []),
    "one waits in a collective, its peer is not stalled yet": ([(10.0, True), (0.1, False)], 0.0, [], []),
    # a node of a job of several nodes: a hung peer elsewhere is its own node's to kill first
    "both wait in a collective, within the grace for remote peers": ([(10.0, True), (10.0, True)], 30.0, [], []),
    "both wait in a collective, past the grace for remote peers": ([(10.0, True), (10.0, True)], 2.0, [0, 1], []),
    "one hung here, the other waits: no grace for a local hang": ([(10.0, False), (10.0, True)], 30.0, [0], [1]),
}


@pytest.mark.parametrize("case", list(WHO_HANGS))
def test_the_detector_kills_the_hung_rank_and_keeps_those_waiting_for_it(case, tmp_path, sleepers):
    workers, grace, killed, kept = WHO_HANGS[case]
    d = heartbeat_dir(tmp_path)
    d.mkdir()
    for rank, ((age, collective), proc) in enumerate(zip(workers, sleepers)):
        (d / f"agent{os.getpid()}-local{rank}.json").write_text(
            json.dumps(
                {
                    "phase": "step",
                    "step": 30,
                    "rank": rank,
                    "pid": proc.pid,
                    "time": time.time() - age,
                    "collective": collective,
                }
            )
        )
    found = []
    HangDetector(tmp_path, {"step": 5.0}, found.append, remote_grace_s=grace).scan()
    assert [(e["ranks"], e["kept"]) for e in found] == ([(killed, kept)] if killed else [])
    for rank, proc in enumerate(sleepers):
        assert (proc.wait(30) == -9) if rank in killed else proc.poll() is None


def test_a_worker_whose_dump_file_cannot_be_made_trains_on_and_its_hang_is_found_without_stacks(tmp_path):
    """Stack dumps are a diagnosis: a worker whose dump file cannot be opened (its directory gone,
    a full disk) says so and goes on; the detector then finds no dump and kills it as before."""
    missing = tmp_path / "gone" / "agent1-local0.stack"
    dump_on_signal(missing)  # in this process: nothing registered, no exception
    assert take_dump(os.getpid(), missing) == ""  # no file: no signal sent (it would end a process without a handler)
