"""``pretrain stacks``: where each live worker of a running campaign is, from another terminal,
without stopping it; a process whose pid a dead worker's record names but which is not that
job's worker is never signalled (SIGUSR1 would end it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pretrain.cli.app import app
from support.campaigns import wait_for
from trainer.resilience.heartbeat import heartbeat_dir
from trainer.resilience.stacks import stack_path

ROOT = Path(__file__).resolve().parents[2]
WORKER = """if True:
    import json, os, sys, time
    sys.path.insert(0, {root!r})
    from pathlib import Path
    from trainer.resilience.stacks import dump_on_signal
    dump_on_signal(Path({stack!r}))
    def read_forever():
        r, w = os.pipe()
        Path({record!r}).write_text(json.dumps({{"pid": os.getpid(), "rank": 1, "phase": "step", "step": 7}}))
        os.read(r, 1)
    read_forever()
"""


@pytest.fixture
def processes():
    started = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def test_stacks_names_where_each_live_worker_is_and_leaves_it_and_other_processes_running(tmp_path, processes):
    job = tmp_path / "wd" / "jobs" / "main" / "attempt_002"
    beats = heartbeat_dir(job)
    beats.mkdir(parents=True)
    record = beats / "agent1-local1.json"
    code = WORKER.format(root=str(ROOT), stack=str(stack_path(record)), record=str(record))
    # a worker's command line: python -m trainer.worker <its job's job.json>
    worker = subprocess.Popen([sys.executable, "-c", code, "trainer.worker", str(job / "job.json")])
    other = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])  # not a worker of the job
    processes += [worker, other]
    (beats / "agent1-local0.json").write_text(json.dumps({"pid": other.pid, "rank": 0, "phase": "step", "step": 7}))
    (beats / "agent1-local2.json").write_text("{damaged")
    wait_for(record.exists, 30, "the worker's heartbeat record")
    line = "stage main attempt 2 rank 1 (pid {}, step 7, in 'step'): read_forever (<string>:{})".format(
        worker.pid, code.splitlines().index("        os.read(r, 1)") + 1
    )

    def shown() -> str:
        out = CliRunner().invoke(app, ["stacks", "--workdir", str(tmp_path / "wd")])
        assert out.exit_code == 0, out.output
        return out.output

    # (a first look may still find it writing its record: until one finds it in its read)
    wait_for(lambda: shown() == line + "\n", 30, "the worker shown blocked in its read")
    full = CliRunner().invoke(app, ["stacks", "--workdir", str(tmp_path / "wd"), "--full"])
    assert full.output.startswith(line) and "Current thread 0x" in full.output
    assert worker.poll() is None and other.poll() is None  # both still running


def test_stacks_without_a_running_job_says_so(tmp_path):
    (tmp_path / "wd" / "jobs" / "main" / "attempt_000").mkdir(parents=True)
    out = CliRunner().invoke(app, ["stacks", "--workdir", str(tmp_path / "wd")])
    assert out.exit_code == 1 and "no live worker of the campaign" in out.output
