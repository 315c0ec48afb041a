"""The client's handle on a child the zygote forked (``trainer.zygote.client``): a
``subprocess.Popen`` look-alike fed by the zygote's messages on the child's connection (its exit
status), which polls the pid itself once the zygote is gone."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import threading
import time

from trainer.common.process import signal_process


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not); for a child the zygote can no longer report."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


class ZygoteProcess:
    """A child forked by the zygote, handled as a ``subprocess.Popen`` (``pid``, ``returncode``,
    ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``); the exit status is the one
    Popen reports (negative: the signal that ended it). The child is stopped when this handle's
    connection closes, so keep the handle while the child should run."""

    def __init__(self, args: list[str], conn: socket.socket, pid: int, buffered: bytes = b""):
        self.args, self.pid, self.returncode = args, pid, None
        self._conn: socket.socket | None = conn
        self._buf = buffered
        self._lock = threading.Lock()
        self._take_messages()

    def _take_messages(self) -> None:
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            message = json.loads(line)
            if "exit" in message:
                self.returncode = message["exit"]
                self._close()

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _read(self, timeout: float) -> None:
        """Take what the zygote said within ``timeout`` seconds (under the lock)."""
        if self._conn is None:  # the zygote is gone: the child ends with it (its orphan rule)
            if not _running(self.pid):
                self.returncode = -signal.SIGKILL
            elif timeout:
                time.sleep(min(timeout, 0.05))  # polls a process that is not our child
            return
        if select.select([self._conn], [], [], timeout)[0]:
            try:
                data = self._conn.recv(4096)
            except OSError:
                data = b""
            if not data:
                self._close()
                return
            self._buf += data
            self._take_messages()

    def exit_fd(self) -> int | None:
        """Readable once the zygote reports this child's exit (``trainer.common.process.wait_for_an_exit``);
        None when the zygote is gone (the child is then polled)."""
        return None if self._conn is None else self._conn.fileno()

    def poll(self) -> int | None:
        if self.returncode is None and self._lock.acquire(blocking=False):
            try:
                self._read(0)
            finally:
                self._lock.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            with self._lock:
                if self.returncode is None:
                    self._read(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never signal a pid that may have been reused
            signal_process(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"<ZygoteProcess pid={self.pid} returncode={self.returncode}>"
