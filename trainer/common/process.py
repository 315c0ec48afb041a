"""Process helpers shared by the launcher and the workers."""

from __future__ import annotations

import atexit
import os
import select
import signal
import sys
import threading
from collections.abc import Iterable, Mapping
from typing import NoReturn


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True


def signal_process(pid: int, sig: int, group: bool = False) -> None:
    """Send ``sig`` to process ``pid`` (``group``: to the process group it leads), which may be gone
    already (or its pid taken by another user's process): then nothing happens."""
    try:
        os.killpg(pid, sig) if group else os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def exit_fd(proc) -> tuple[int | None, bool]:
    """A descriptor that turns readable when ``proc`` exits, and whether the caller must close it:
    a ``ZygoteProcess``'s connection to its zygote (the zygote writes the exit status there), a
    ``subprocess.Popen``'s pidfd (Linux ≥ 5.3; opened only for a child not reaped yet, whose pid
    cannot have been reused). (None, False) where there is none."""
    if hasattr(proc, "exit_fd"):
        return proc.exit_fd(), False
    try:
        return os.pidfd_open(proc.pid), True
    except (AttributeError, OSError):  # no pidfd on this system, or the process is gone already
        return None, False


def wait_for_an_exit(procs: Iterable, timeout: float) -> None:
    """Sleep until one of ``procs`` (not yet known to have exited: ``returncode`` None) may have
    exited, at most ``timeout`` seconds. The caller polls them afterwards: an exit is noticed as
    it happens instead of at the next tick of a polling loop. A process without a descriptor to
    wait on (its zygote gone) is noticed at the latest after ``timeout``."""
    fds, owned = [], []
    try:
        for proc in procs:
            fd, own = exit_fd(proc)
            if fd is not None:
                fds.append(fd)
            if own:
                owned.append(fd)
        select.select(fds, [], [], timeout)
    finally:
        for fd in owned:
            os.close(fd)


PARENT_ENV = "PRETRAIN_PARENT_PID"  # the pid of the process that started this one (see child_env)


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for a child this process starts with Popen, naming this
    process as the parent its orphan watchdog must see: a child whose parent died before its
    watchdog ran would otherwise take its new parent (init, a subreaper) for its own."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def exit_when_orphaned(on_orphan=None, interval: float = 0.5) -> threading.Thread:
    """Start a daemon thread that ends this process once its parent is gone.

    A launcher whose orchestrator died, or a worker whose agent died, must not keep training
    and writing checkpoints beside the process that resumes the campaign. ``on_orphan`` runs
    first (e.g. to stop children); then the process exits with SIGTERM's status. A parent that
    ``child_env`` named and that is gone already (it died while this process was starting) makes
    this process an orphan from the start; a named process that lives but is not the parent (a
    grandparent's name, inherited by a child started without ``child_env``) is not looked at.
    """
    parent = os.getppid()
    named = os.environ.get(PARENT_ENV, "")
    if named.isdigit() and int(named) != parent and not pid_alive(int(named)):
        parent = -1  # orphaned before this watchdog ran: the first look ends the process
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(interval):
            if os.getppid() != parent:
                if on_orphan is not None:
                    on_orphan()
                os._exit(128 + signal.SIGTERM)

    t = threading.Thread(target=watch, name="orphan-watchdog", daemon=True)
    t.start()
    return t


def exit_now(code: int | str | None = 0) -> NoReturn:
    """Leave as ``sys.exit(code)`` would (non-daemon threads joined, atexit handlers run: Prefect
    drains its logs and events there, streams flushed) but without the interpreter's teardown of
    every module, which whoever started the process waits for: 0.4 s with torch imported, 1.6 s
    with the CLI's imports (torch, Prefect, MLflow), 0.8 s for a zygote."""
    if isinstance(code, str):  # sys.exit("message"): printed, status 1
        print(code, file=sys.stderr)
        code = 1
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a reader that went away
            pass
    os._exit(code or 0)
