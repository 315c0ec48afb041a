"""The node agent's pieces of elastic training (test_elastic.py) checked on their own, without a
campaign: its changes to torch's rendezvous (checked against this torch), the workers it starts
as fresh interpreters, a standby node's wait for the job's rendezvous, and the streams of the
workers torch's agent starts."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from support.campaigns import wait_for
from trainer.agent.elastic import wait_to_stand_by
from trainer.resilience.heartbeat import heartbeat_dir


def test_the_rendezvous_reads_its_store_every_tenth_of_a_second():
    """Torch's rendezvous sleeps 1 s between looks at its store and serves a cached state for 1 s;
    a node agent makes both 0.1 s (``trainer.agent.torch_internals.fast_rendezvous_polls``). Checked in a fresh
    interpreter against this torch, so an upgrade that renames the internals is noticed."""
    probe = """
from unittest import mock
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv
from trainer.agent.torch_internals import fast_rendezvous_polls
slept = []
with mock.patch("time.sleep", slept.append):
    fast_rendezvous_polls()
    fast_rendezvous_polls()  # idempotent
    rdzv._delay(seconds=1)
holder = rdzv._BackendRendezvousStateHolder(mock.Mock(), mock.Mock())
print(slept, holder._cache_duration)
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[0.1]", "0.1"], out.stdout


def test_a_node_waiting_for_a_round_that_filled_up_without_it_stands_by():
    """Torch leaves such a node on its wait list, and the participants' agents restart their workers
    again and again to take it in (``trainer.agent.torch_internals.stand_by_when_round_full``): it moves to the
    redundancy list instead. Every other case is torch's own decision. Checked in a fresh
    interpreter against this torch's join operation."""
    probe = """
from datetime import timedelta
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings, RendezvousTimeout, _NodeDesc, _RendezvousContext, _RendezvousJoinOp, _RendezvousState)
from trainer.agent.torch_internals import stand_by_when_round_full
a, b, me = (_NodeDesc("h", pid, 0) for pid in (1, 2, 3))
settings = RendezvousSettings("run", 1, 2, RendezvousTimeout(), timedelta(seconds=1), 3)
def state(participants, wait=(), redundant=(), complete=True, closed=False):
    s = _RendezvousState()
    s.participants, s.wait_list, s.redundancy_list = {n: 0 for n in participants}, set(wait), set(redundant)
    s.complete, s.closed = complete, closed
    return s
cases = [state([a, b], wait=[me]),  # the round filled up without it: leaves the wait list
         state([a, b]),  # then: torch's redundancy list
         state([a], wait=[me]),  # a free place: it waits for the next round (torch)
         state([a, b], wait=[me], closed=True),  # the job ended (torch)
         state([a, b], redundant=[me])]  # already standing by (torch)
stand_by_when_round_full()
stand_by_when_round_full()  # idempotent
far = 1e12
print(" ".join(_RendezvousJoinOp()(_RendezvousContext(me, s, settings), far).name for s in cases))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["REMOVE_FROM_WAIT_LIST", "ADD_TO_REDUNDANCY_LIST", "SYNC", "ERROR_CLOSED", "SYNC"], (
        out.stdout
    )


def test_a_fresh_interpreter_worker_gets_its_node_and_threads_in_its_own_environment():
    """Without a zygote (a Kubernetes pod's agent) torch's agent starts each worker as a fresh
    interpreter: the node index and thread count reach the worker through its command (``env``),
    not through the agent's own environment."""
    from trainer.agent.elastic import elastic_worker_command

    probe = ["-c", "import os; print(os.environ['PRETRAIN_NODE'], os.environ['OMP_NUM_THREADS'])"]
    command = elastic_worker_command(None, probe, {"PRETRAIN_NODE": "3", "OMP_NUM_THREADS": "2"})
    assert subprocess.run(command, capture_output=True, text=True, timeout=60).stdout == "3 2\n"


def test_a_fresh_interpreter_worker_whose_agent_died_while_it_started_ends():
    """A worker (or warm spare) started without a zygote takes seconds to import torch; an agent
    killed meanwhile (a node lost) must not leave it running as an orphan of init: it knows its
    agent by name and ends. (A CI run left such a spare behind a killed pod.)"""
    # the worker: still "starting" until the test says go, then its orphan watchdog, then "work" until the
    # test closes its end of stdin (so a watchdog that fails leaves no process behind once the test ends)
    worker = [
        "-c",
        "import sys; from trainer.common.process import exit_when_orphaned; sys.stdin.readline(); "
        "exit_when_orphaned(interval=0.05); print('watching', flush=True); sys.stdin.readline()",
    ]
    agent = (
        "import subprocess; from trainer.agent.elastic import elastic_worker_command as c; "
        f"p = subprocess.Popen(c(None, {worker!r}, {{}})); print(p.pid, flush=True)"
    )
    started = subprocess.Popen([sys.executable, "-c", agent], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pid = int(started.stdout.readline())
    assert started.wait(60) == 0  # the agent is gone, its worker still starting
    try:
        started.stdin.write("go\n")
        started.stdin.flush()
        assert started.stdout.readline() == "watching\n"
        wait_for(lambda: not running(pid), 30, "the orphaned worker to end")
    finally:
        started.stdin.close()


def running(pid: int) -> bool:
    """Whether ``pid`` runs (an orphan that ended may stay a zombie until init reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


STAND_BY = {  # the job's rendezvous over time (not yet listening, up, gone; the first round formed) → stands by
    "the rendezvous starts after the standby, then the first round forms": (["not yet", "up", "formed"], True),
    "the rendezvous goes away before the first round formed": (["up", "gone"], False),
    "the rendezvous never listens": (["not yet"], False),
}


@pytest.mark.parametrize("case", list(STAND_BY))
def test_a_standby_waits_for_a_rendezvous_that_is_not_up_yet_and_leaves_one_that_went_away(case, tmp_path):
    """On a loaded machine the standby node's agent can start before the first node's agent hosts
    the rendezvous (CI: it took that for the job's end, left, and the job waited 10 minutes for
    the place it should have filled)."""
    phases, stands_by = STAND_BY[case]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    done = threading.Event()

    def play():
        for phase in phases:
            if phase == "up":
                listener.listen()
            elif phase == "gone":
                listener.close()
            elif phase == "formed":
                heartbeat_dir(tmp_path).mkdir(parents=True, exist_ok=True)
                (heartbeat_dir(tmp_path) / "agent1-local0.json").write_text("{}")
            if done.wait(0.3):  # each phase lasts a few of the standby's looks
                return

    player = threading.Thread(target=play)
    player.start()
    try:
        assert wait_to_stand_by(tmp_path, f"127.0.0.1:{port}", poll_s=0.01, never_up_s=2.0) is stands_by
    finally:
        done.set()
        player.join()
        listener.close()


def test_torchs_agent_starts_workers_that_write_to_the_agents_streams_and_leave_no_directories(
    tmp_path, monkeypatch, capfd
):
    """Every launch of torch's agent on a node made a ``torchelastic_*`` directory (one per round
    and rank under it) in the machine's temporary directory and never removed it: ~1,300 were
    left by one day of test runs here. The worker's output goes to the agent's own streams (the
    job's launcher keeps them), its failure is still reported with its exit code, and nothing is
    written to disk."""
    from torch.distributed.elastic.multiprocessing import start_processes

    from trainer.agent.elastic_launch import ConsoleLogs

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # where torch's default would put its directories
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    try:  # torch's agent takes these signals over in the process that starts workers (this test's)
        ctx = start_processes("w", sys.executable, {0: ("-c", code)}, {0: {"PATH": "/usr/bin:/bin"}}, ConsoleLogs())
        result = None
        while result is None:
            result = ctx.wait(timeout=60, period=0.05)
        ctx.close()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert {rank: f.exitcode for rank, f in result.failures.items()} == {0: 3}
    out, err = capfd.readouterr()
    assert out.splitlines()[0] == "out" and "err" in err.splitlines()
    assert list(tmp_path.iterdir()) == []
