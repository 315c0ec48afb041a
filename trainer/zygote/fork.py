"""The client's side of the zygote's fork protocol (the server's: ``trainer.zygote.server``).

A request is one connection to the zygote's unix socket: ``HEADER`` (the JSON's length), then the
JSON (module, argv, environment, title, working directory, session), the child's fds 0-2 riding on
its first bytes. The zygote answers a line, ``{"pid": …}`` once it forked (after its imports) or
``{"error": …}``, then ``{"exit": …}`` when the child ends, on the same connection
(:class:`~trainer.zygote.process.ZygoteProcess` reads it)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Sequence

from trainer.zygote.process import ZygoteProcess
from trainer.zygote.server import HEADER

Stream = int | object | None  # None: inherit; an open file (anything with fileno()), an fd, or subprocess.DEVNULL


def child_fds(streams: tuple[Stream, Stream, Stream]) -> tuple[list[int], list[int]]:
    """The child's fds 0-2 as Popen would give them, and those opened here (to close once sent)."""
    fds, opened = [], []
    for i, stream in enumerate(streams):
        if stream is subprocess.STDOUT and i == 2:
            fds.append(fds[1])
        elif isinstance(stream, int) and stream >= 0:
            fds.append(stream)
        elif hasattr(stream, "fileno"):
            fds.append(stream.fileno())
        elif stream is None and _is_open(i):
            fds.append(i)
        elif stream is None or stream is subprocess.DEVNULL:
            opened.append(os.open(os.devnull, os.O_RDWR))
            fds.append(opened[-1])
        else:
            for fd in opened:
                os.close(fd)
            raise TypeError(f"a zygote's child cannot be given the stream {stream!r}")
    return fds, opened


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def fork_request(
    module: str, argv: Sequence[str], env: dict[str, str], title: list[str], cwd, new_session: bool
) -> dict:
    """What the zygote is asked to fork: ``python -m module argv`` titled ``title``."""
    return {
        "module": module,
        "argv": list(map(str, argv)),
        "env": env,
        "title": title,
        "cwd": None if cwd is None else os.fspath(cwd),
        "new_session": new_session,
    }


def fork_child(
    path: str,
    server: subprocess.Popen | None,
    ready_timeout_s: float,
    args: list[str],
    request: dict,
    streams: tuple[list[int], list[int]],
) -> ZygoteProcess:
    """Ask the zygote at ``path`` to fork ``request`` (``args``: the child's command line, as
    Popen's) with the fds ``streams`` gives (those it opened are closed here, sent or not);
    ``server``: the zygote when this process started it (its socket is waited for while it runs)."""
    data = json.dumps(request).encode()
    fds, opened = streams
    try:
        conn = _connect(path, server, ready_timeout_s)
        try:
            socket.send_fds(conn, [HEADER.pack(len(data)) + data[:4096]], fds)
            conn.sendall(data[4096:])
            pid, rest = _pid_reply(conn, ready_timeout_s)
        except BaseException:
            conn.close()
            raise
    finally:
        for fd in opened:
            os.close(fd)
    return ZygoteProcess(args, conn, pid, rest)


def _connect(path: str, server: subprocess.Popen | None, ready_timeout_s: float) -> socket.socket:
    """A connection to the zygote, waiting while it is still starting."""
    deadline = time.monotonic() + ready_timeout_s
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            return conn
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
            if server is None or server.poll() is not None:
                raise ConnectionError("the zygote is not running") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"the zygote did not start within {ready_timeout_s:.0f}s") from None
            time.sleep(0.02)  # polls the server's socket appearing (it binds first thing)


def _pid_reply(conn: socket.socket, ready_timeout_s: float) -> tuple[int, bytes]:
    """The forked child's pid (the zygote answers once its imports are done), and what followed it."""
    conn.settimeout(ready_timeout_s)
    data = b""
    while b"\n" not in data:
        try:
            more = conn.recv(4096)
        except TimeoutError:
            raise TimeoutError(f"the zygote did not answer within {ready_timeout_s:.0f}s") from None
        if not more:
            raise ConnectionError("the zygote closed the connection (it died)")
        data += more
    line, rest = data.split(b"\n", 1)
    reply = json.loads(line)
    if "pid" not in reply:
        raise ConnectionError(f"the zygote refused the request: {reply.get('error', reply)}")
    conn.settimeout(None)
    return reply["pid"], rest
