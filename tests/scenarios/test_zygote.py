"""The zygote (trainer.zygote.client): processes forked with torch imported behave as fresh interpreters
started by ``subprocess.Popen``, die with their owner, and a broken zygote falls back to Popen."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from pretrain.cluster.local import LocalCluster
from pretrain.spec.cluster import ClusterSpec
from support.campaigns import wait_for
from trainer.common.process import wait_for_an_exit
from trainer.zygote.client import Zygote
from trainer.zygote.process import ZygoteProcess

REPO = str(Path(__file__).resolve().parents[2])

PROBE = """
import json, os, signal, sys, time
mode = sys.argv[1]
if mode == "report":
    print(json.dumps({"name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ),
                      "stdin": sys.stdin.read(), "own_session": os.getsid(0) == os.getpid()}))
    print("to stderr", file=sys.stderr)
elif mode == "exit":
    sys.exit(int(sys.argv[2]))
elif mode == "message":
    sys.exit("giving up: no data")
elif mode == "raise":
    raise RuntimeError("boom")
elif mode == "suicide":
    os.kill(os.getpid(), getattr(signal, sys.argv[2]))
elif mode == "sleep":
    signal.pause()
elif mode == "trap":  # ends with status 7 on SIGTERM
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    print("ready", flush=True)
    signal.pause()
elif mode == "agent":  # as a node agent: an orphan watchdog, and a worker that watches it in turn
    import subprocess
    from trainer.common.process import exit_when_orphaned
    exit_when_orphaned()
    # the worker says when its watchdog runs: one started after its parent died would watch the
    # wrong parent (the test's owner is killed right after the pids are printed)
    worker = subprocess.Popen([sys.executable, "-c",
                               "import signal; from trainer.common.process import exit_when_orphaned; "
                               "exit_when_orphaned(); print('watching', flush=True); signal.pause()"],
                              stdout=subprocess.PIPE, text=True)
    worker.stdout.readline()
    print(worker.pid, flush=True)
    signal.pause()
"""


@pytest.fixture(scope="module")
def probe_env(tmp_path_factory) -> dict[str, str]:
    """An environment whose PYTHONPATH holds the probe module (not on the zygote's own path)."""
    d = tmp_path_factory.mktemp("probe")
    (d / "zprobe.py").write_text(PROBE)
    return {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join([str(d), REPO]), "ZYGOTE_TEST": "yes"}


@pytest.fixture(scope="module")
def zygote():
    with Zygote.start(env={**os.environ, "PYTHONPATH": REPO}) as z:  # the real preload: torch and the entry points
        # ready before a test's shim connects to it (a client given only the path does not wait
        # for a zygote still starting: it starts fresh interpreters)
        assert z.spawn("platform", stdout=subprocess.DEVNULL).wait(120) == 0
        yield z


def run(zygote: Zygote | None, env, tmp_path: Path, *argv: str, **kwargs):
    """The probe run to its end, forked or (zygote None) a fresh interpreter: (code, stdout, stderr)."""
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "wb") as o, open(err, "wb") as e:
        if zygote is None:
            proc = subprocess.Popen(
                [sys.executable, "-m", "zprobe", *argv], stdout=o, stderr=e, env=env, stdin=subprocess.DEVNULL, **kwargs
            )
        else:
            proc = zygote.spawn("zprobe", argv, stdout=o, stderr=e, env=env, stdin=subprocess.DEVNULL, **kwargs)
    return proc.wait(60), out.read_text(), err.read_text()


def test_a_forked_module_runs_as_main_with_exactly_the_env_argv_cwd_and_fds_asked_for(zygote, probe_env, tmp_path):
    stdin = tmp_path / "in"
    stdin.write_text("fed on stdin")
    out, err = tmp_path / "o", tmp_path / "e"
    with open(stdin, "rb") as i, open(out, "wb") as o, open(err, "wb") as e:
        proc = zygote.spawn(
            "zprobe", ["report", "an arg"], env=probe_env, cwd=tmp_path, stdin=i, stdout=o, stderr=e, new_session=True
        )
    assert isinstance(proc, ZygoteProcess) and proc.wait(60) == 0 and proc.returncode == 0
    seen = json.loads(out.read_text())
    assert seen["name"] == "__main__" and seen["argv"][1:] == ["report", "an arg"]
    assert seen["argv"][0].endswith("zprobe.py")
    assert seen["cwd"] == str(tmp_path) and seen["env"] == probe_env
    assert seen["stdin"] == "fed on stdin" and seen["own_session"]
    assert err.read_text() == "to stderr\n"


@pytest.mark.parametrize(
    "argv",
    [
        ("exit", "0"),
        ("exit", "3"),
        ("message",),
        ("raise",),
        ("suicide", "SIGKILL"),
        ("suicide", "SIGTERM"),
        ("suicide", "SIGINT"),
    ],
)
def test_exit_codes_and_signal_deaths_are_reported_as_popen_reports_them(zygote, probe_env, tmp_path, argv):
    forked, fresh = run(zygote, probe_env, tmp_path, *argv), run(None, probe_env, tmp_path, *argv)
    assert forked[0] == fresh[0]
    assert forked[2].strip().splitlines()[-1:] == fresh[2].strip().splitlines()[-1:]  # the same last error line


def test_a_running_child_is_waited_signalled_and_listed_as_popen_would_show_it(zygote, probe_env):
    proc = zygote.spawn("zprobe", ["sleep"], env=probe_env, stdout=subprocess.DEVNULL)
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    assert psutil.Process(proc.pid).cmdline()[:4] == [sys.executable, "-m", "zprobe", "sleep"]
    proc.terminate()
    assert proc.wait(30) == -signal.SIGTERM and proc.poll() == -signal.SIGTERM


@pytest.mark.parametrize("forked", [True, False], ids=["zygote", "popen"])
def test_an_agent_waiting_on_its_workers_wakes_when_one_dies_not_at_its_timeout(zygote, probe_env, forked):
    """The node agent starts a recovery as a worker dies (``wait_for_an_exit``), not at its next
    polling tick; a wait where nobody dies ends at its timeout."""
    start = (
        (lambda mode: zygote.spawn("zprobe", [mode], env=probe_env, stdout=subprocess.DEVNULL))
        if forked
        else (
            lambda mode: subprocess.Popen(
                [sys.executable, "-m", "zprobe", mode], env=probe_env, stdout=subprocess.DEVNULL
            )
        )
    )
    kept, doomed = start("sleep"), start("sleep")
    try:
        wait_for_an_exit([kept, doomed], 0.01)
        assert kept.poll() is None and doomed.poll() is None
        doomed.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        wait_for_an_exit([kept, doomed], 20)
        assert time.monotonic() - t0 < 10, "woken by the timeout, not by the exit"
        assert doomed.poll() == -signal.SIGKILL and kept.poll() is None
    finally:
        for proc in (kept, doomed):
            proc.kill()
            proc.wait(30)


def test_a_child_stopped_right_after_it_was_forked_ends_by_that_signal(zygote, probe_env):
    """An agent may stop a worker the moment it is told its pid (a fast recovery given up at
    once): the signal must not be taken by the zygote's own handler the child inherited (it was,
    31 times in 40, and the agent waited 30 s before SIGKILL)."""
    for _ in range(20):
        proc = zygote.spawn("zprobe", ["sleep"], env=probe_env, stdout=subprocess.DEVNULL)
        proc.terminate()
        try:
            assert proc.wait(10) == -signal.SIGTERM
        finally:
            proc.kill()


def sleeping_probes() -> list[int]:
    return [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if (p.info["cmdline"] or [])[:4] == [sys.executable, "-m", "zprobe", "sleep"]
    ]


def exec_through(zygote: Zygote, env, *argv: str) -> subprocess.Popen:
    """The probe as torch's elastic agent starts a worker: a command line, ``trainer.zygote_exec``."""
    return subprocess.Popen(
        [sys.executable, "-m", "trainer.zygote_exec", "--zygote", zygote.path, "zprobe", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.mark.parametrize(
    "argv", [("exit", "0"), ("exit", "3"), ("message",), ("suicide", "SIGKILL"), ("suicide", "SIGTERM")]
)
def test_a_command_line_run_through_the_zygote_ends_as_its_child_ended(zygote, probe_env, tmp_path, argv):
    shim = exec_through(zygote, probe_env, *argv)
    out, err = shim.communicate(timeout=60)
    assert shim.returncode == run(None, probe_env, tmp_path, *argv)[0], err


def test_a_command_line_run_through_the_zygote_is_the_forked_child_and_passes_signals_on(zygote, probe_env, tmp_path):
    shim = exec_through(zygote, probe_env, "report", "--shm", "x")  # its options are the child's
    out, err = shim.communicate(timeout=60)
    seen = json.loads(out)
    assert shim.returncode == 0 and seen["argv"][1:] == ["report", "--shm", "x"], err
    fresh = json.loads(run(None, probe_env, tmp_path, "report")[1])  # as a fresh interpreter sees it (locale coercion)
    assert seen["env"] == fresh["env"]
    assert err == "to stderr\n"
    before = set(sleeping_probes())
    shim = exec_through(zygote, probe_env, "sleep")
    child = wait_for(lambda: [p for p in sleeping_probes() if p not in before], 30, "the forked child")
    assert [psutil.Process(pid).ppid() for pid in child] != [shim.pid]  # the zygote's child, not a fresh interpreter
    shim.kill()
    wait_for(lambda: gone(child), 30, "the child of a shim that died to be stopped")
    shim = exec_through(zygote, probe_env, "trap")
    assert shim.stdout.readline() == "ready\n"
    os.killpg(shim.pid, signal.SIGTERM)  # what torch's agent does to stop a worker: its process group
    assert shim.wait(30) == 7  # the child got the signal, and the shim ended as the child did


def gone(pids: list[int]) -> bool:
    def running(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return not any(running(pid) for pid in pids)


def test_the_owner_killed_leaves_no_forked_process_and_no_directory(probe_env, tmp_path):
    owner = tmp_path / "owner.py"
    owner.write_text(
        textwrap.dedent("""
        import json, os, sys, signal
        from trainer.zygote.client import Zygote
        env = json.loads(sys.argv[1])
        z = Zygote.start(preload=["trainer.common.process"], env=env)
        r, w = os.pipe()
        agent = z.spawn("zprobe", ["agent"], env=env, stdout=w, new_session=True)  # a worker under it
        plain = z.spawn("zprobe", ["sleep"], env=env)  # no watchdog of its own
        os.close(w)
        worker = int(os.fdopen(r).readline())
        print(json.dumps([z._server.pid, agent.pid, worker, plain.pid]), flush=True)
        print(z.path, flush=True)
        signal.pause()
    """)
    )
    proc = subprocess.Popen(
        [sys.executable, str(owner), json.dumps(probe_env)], stdout=subprocess.PIPE, text=True, env=probe_env
    )
    try:
        pids = json.loads(proc.stdout.readline())
        home = Path(proc.stdout.readline().strip()).parent
        assert len(pids) == 4 and not gone(pids) and home.is_dir()
    finally:
        proc.kill()
        proc.wait()
    wait_for(lambda: gone(pids), 30, "the zygote and every process forked from it to end with their owner")
    assert not home.exists(), f"the zygote's directory is left behind: {sorted(p.name for p in home.iterdir())}"


def test_a_client_gone_stops_the_children_it_asked_for(zygote, probe_env, tmp_path):
    client, child = sleeping_child_of_a_client(zygote, probe_env)
    try:
        assert not gone([child])
    finally:
        client.kill()
        client.wait()
    wait_for(lambda: gone([child]), 30, "the child of a client that died to be stopped")


@pytest.mark.parametrize("client_gone", [True, False])
def test_a_stopped_child_does_not_outlive_the_zygote(probe_env, client_gone):
    """The campaign ends (the zygote stops) while a child is stopped (a frozen node's saver), its
    client (the agent) killed just before or not: the child ends too, never left behind stopped
    with a SIGTERM pending for ever."""
    with Zygote.start(preload=["trainer.common.process"], env=probe_env) as z:
        assert z.spawn("platform", stdout=subprocess.DEVNULL).wait(120) == 0  # ready before the client connects
        client, child = sleeping_child_of_a_client(z, probe_env)
        os.kill(child, signal.SIGSTOP)
        wait_for(lambda: psutil.Process(child).status() == psutil.STATUS_STOPPED, 30, "the child stopped")
        if client_gone:
            client.kill()
            wait_for(lambda: sigterm_pending(child), 30, "the zygote to send the child its SIGTERM")
            assert not gone([child])  # within its grace (STOP_GRACE_S): stopped, its SIGTERM pending
    try:
        wait_for(lambda: gone([child]), 30, "the stopped child to end with the zygote")
    finally:
        client.kill()
        client.wait()


def sleeping_child_of_a_client(zygote: Zygote, probe_env) -> tuple[subprocess.Popen, int]:
    """Another process (as a node agent) that asked ``zygote`` for a sleeping child: (it, the child's pid)."""
    client = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import signal
        from trainer.zygote.client import Zygote
        child = Zygote.connect({zygote.path!r}).spawn("zprobe", ["sleep"], env={probe_env!r})
        print(child.pid, flush=True)
        signal.pause()
    """),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=probe_env,
    )
    return client, int(client.stdout.readline())


def sigterm_pending(pid: int) -> bool:
    """Whether ``pid`` has a SIGTERM pending (Linux: its /proc status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    pending = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask & (1 << (signal.SIGTERM - 1)) for mask in pending)


def test_a_killed_zygote_falls_back_to_popen_saying_so_once(probe_env, tmp_path):
    said = []
    z = Zygote.start(preload=["trainer.common.process"], env=probe_env, log=said.append)
    try:
        assert isinstance(z.spawn("zprobe", ["exit", "0"], env=probe_env), ZygoteProcess), said  # why it fell back
        z._server.kill()
        z._server.wait()
        for code in (4, 5):
            assert run(z, probe_env, tmp_path, "exit", str(code)) == (code, "", "")
        assert len(said) == 1 and "fresh interpreter" in said[0]
    finally:
        z.close()


def test_a_zygote_that_cannot_be_reached_falls_back_to_popen(probe_env, tmp_path):
    said = []
    z = Zygote.connect(str(tmp_path / "no-such-socket"), log=said.append)
    assert run(z, probe_env, tmp_path, "report")[0] == 0 and len(said) == 1 and not z.usable


def test_the_node_check_runs_forked_from_the_zygote(zygote, tmp_path):
    """Two check processes forked with torch imported measure matmul and allreduce between them."""
    cluster = LocalCluster(ClusterSpec(nodes_min=1, nodes_max=2, workers_per_node=1), zygote=zygote)
    rows = cluster.health_check(tmp_path)
    assert [r["ok"] for r in rows] == [True, True], rows
    assert all(r["matmul_s"] > 0 and r["allreduce_MBps"] > 0 for r in rows)


CHILD = """
import os, signal, sys, time
while not os.path.exists(sys.argv[1]):  # a start slower than its parent's life
    time.sleep(0.05)
from trainer.common.process import exit_when_orphaned
exit_when_orphaned()
signal.pause()
"""


def test_a_child_whose_parent_died_before_its_watchdog_ran_still_ends(tmp_path):
    """``child_env`` names the parent: a child that starts its orphan watchdog only after its
    parent died (a slow start on a loaded machine) ends, instead of taking its new parent (init,
    a subreaper) for its own and living on."""
    go = tmp_path / "go"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import subprocess, sys
        from trainer.common.process import child_env
        print(subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env=child_env()).pid, flush=True)
    """),
            CHILD,
            str(go),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    child = int(parent.stdout.readline())
    assert parent.wait(30) == 0
    go.touch()  # the child's watchdog starts now, its parent long gone
    try:
        wait_for(lambda: gone([child]), 30, "the orphaned child to end")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
