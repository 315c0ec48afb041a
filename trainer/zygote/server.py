"""The zygote's server side: ``python -m trainer.zygote --socket PATH --owner PID --preload a,b``
(started by :meth:`trainer.zygote.client.Zygote.start`; the client's side of the fork protocol:
``trainer.zygote.fork``).

One single-threaded process imports the heavy modules once (torch, the trainer's entry points;
it never runs a torch op, so no OpenMP pool exists at fork: the only other thread is OpenBLAS's,
which its own fork handler takes care of), then serves requests on a unix socket. Each request
is forked into a child that becomes ``python -m MODULE ARGV...`` with exactly the environment,
working directory, standard streams and session asked for; the server reaps its children and
sends each exit status to the connection that asked for it.

Lifetime: a child lives while the connection that asked for it is open (the client process
dies → its connections close → its children get SIGTERM, then SIGKILL after a grace), and the
zygote lives while its owner does (the process that started it: gone → every child gets
SIGTERM and the zygote exits; the children's own orphan watchdogs, ``trainer.common.process``, see
their parent gone too).
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import time
import traceback
from dataclasses import dataclass

from trainer.common.process import exit_now, signal_process

HEADER = struct.Struct("!I")  # request: its JSON's length, then the JSON; three fds ride on the first bytes
LOG = "zygote.log"  # the server's stderr, in the directory of its socket
STOP_GRACE_S = 10.0  # a child whose client is gone: SIGTERM, then SIGKILL after this long
READ_TIMEOUT_S = 5.0  # a client that connects but never sends its request holds the loop this long at most


@dataclass
class Child:
    conn: socket.socket | None  # the connection that asked for it (None: its client is gone)
    own_group: bool  # started in a new session: signals go to its process group
    kill_at: float | None = None  # when a SIGTERMed child gets SIGKILL


def exit_code(code: object) -> int:
    """The status ``sys.exit(code)`` gives a fresh interpreter (a message: printed, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    conn.settimeout(READ_TIMEOUT_S)
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
        more = conn.recv(1 << 16)
        if not more:
            for fd in fds:
                os.close(fd)
            raise ConnectionError("the client hung up in the middle of its request")
        data += more
    (size,) = HEADER.unpack_from(data)
    return json.loads(data[HEADER.size : HEADER.size + size]), fds


def send(conn: socket.socket | None, message: dict) -> None:
    if conn is None:
        return
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass  # the client is gone: the disconnect is handled by the loop


def signal_child(pid: int, child: Child, sig: int) -> None:
    signal_process(pid, sig, group=child.own_group)


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP; Linux: its /proc state; elsewhere False)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def set_cmdline(args: list[str]) -> None:
    """Show ``args`` as this process's command line (``ps``, psutil: a forked agent reads as
    ``python -m trainer.launch ...``, not as the zygote), as far as the zygote's argv memory
    reaches (its ``--title-room`` argument reserves it). Linux only; elsewhere a no-op."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49 of proc(5)
    except (OSError, IndexError, ValueError):
        return
    data, room = b"", end - start
    for arg in args:
        encoded = arg.encode(errors="replace") + b"\0"
        if len(data) + len(encoded) > room:
            break
        data += encoded
    ctypes.memmove(start, data + b"\0" * (room - len(data)), room)


def become(request: dict, fds: list[int], close: list[int]) -> None:
    """In the forked child: turn into ``python -m MODULE ARGV`` as asked, run it, exit with its
    status. Never returns (the server's loop is still on this stack)."""
    code = 1
    try:
        for fd in close:
            os.close(fd)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # one sent meanwhile ends us now
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if request.get("new_session"):
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        if request.get("cwd"):
            os.chdir(request["cwd"])
        env = request["env"]
        # this forked process becomes the requested program (no exec follows, that is the point of
        # the zygote): its environment is the one its starter asked for, what execve's envp would be;
        # the zygote's own environment and its other children's are untouched
        os.environ.clear()
        os.environ.update(env)
        for entry in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        if env.get("PYTHONUNBUFFERED"):
            for stream in (sys.stdout, sys.stderr):
                stream.reconfigure(write_through=True)
        module = request["module"]
        set_cmdline(request.get("title") or [sys.executable, "-m", module, *request["argv"]])
        sys.modules.pop(module, None)  # preloaded: run afresh as __main__, as `python -m` does
        sys.argv = [module, *request["argv"]]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = exit_code(e.code)
        except KeyboardInterrupt:
            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        if code == -signal.SIGINT:  # an uncaught Ctrl-C ends a fresh interpreter by SIGINT
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


class Server:
    """The fork loop: accept requests, fork, reap, report; end with the owner."""

    def __init__(self, path: str, owner: int):
        self.owner = owner
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)  # first thing: clients can queue their requests while the imports run
        self.listener.listen(64)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the loop through the pipe
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")
        self.children: dict[int, Child] = {}
        self.stopping = False
        signal.signal(signal.SIGTERM, self.stop)

    def stop(self, *_) -> None:
        self.stopping = True

    def serve(self) -> None:
        while os.getppid() == self.owner and not self.stopping:
            now = time.monotonic()
            deadlines = [c.kill_at - now for c in self.children.values() if c.kill_at is not None]
            for key, _ in self.selector.select(timeout=max(0.0, min([0.5, *deadlines]))):
                if key.data == "accept":
                    self.accept()
                elif key.data == "wake":
                    self.drain_wakeups()
                else:
                    self.client_readable(key.fileobj, key.data)
            self.reap()
            now = time.monotonic()
            for pid, child in self.children.items():
                if child.kill_at is not None and child.kill_at <= now:
                    signal_child(pid, child, signal.SIGKILL)
                    child.kill_at = None
        for pid, child in self.children.items():  # the owner is gone (or stops us): so is every child's reason to live
            # one told to go already (its client gone) is in a grace this zygote cannot wait out, and a stopped one (a
            # frozen node's) would keep a SIGTERM pending for ever: SIGKILL
            signal_child(pid, child, signal.SIGKILL if child.kill_at is not None or stopped(pid) else signal.SIGTERM)

    def drain_wakeups(self) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        try:
            request, fds = read_request(conn)
        except (OSError, ValueError) as e:
            send(conn, {"error": f"bad request: {e}"})
            conn.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        close = [
            self.listener.fileno(),
            self.selector.fileno(),
            self.wake_r,
            self.wake_w,
            conn.fileno(),
            *(c.conn.fileno() for c in self.children.values() if c.conn is not None),
        ]
        # SIGTERM is blocked across the fork: the child inherits the server's handler, and one sent
        # to it before ``become`` restored the default would be taken by that handler and lost
        # (its client, told the pid at once, may stop it right away); ``become`` unblocks it
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            pid = os.fork()
        except OSError as e:
            send(conn, {"error": f"fork failed: {e}"})
            pid = None
        if pid == 0:
            become(request, fds, close)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        for fd in fds:
            os.close(fd)
        if pid is None:
            conn.close()
            return
        conn.setblocking(False)
        self.children[pid] = Child(conn, bool(request.get("new_session")))
        self.selector.register(conn, selectors.EVENT_READ, pid)
        send(conn, {"pid": pid})

    def client_readable(self, conn: socket.socket, pid: int) -> None:
        try:
            if conn.recv(4096):
                return  # nothing is expected from a client after its request
        except BlockingIOError:
            return
        except OSError:
            pass
        self.forget(conn)  # the client is gone: so is its child's reason to live
        child = self.children.get(pid)
        if child is not None:
            child.conn = None
            signal_child(pid, child, signal.SIGTERM)
            child.kill_at = time.monotonic() + STOP_GRACE_S

    def forget(self, conn: socket.socket) -> None:
        self.selector.unregister(conn)
        conn.close()

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.pop(pid, None)
            if child is not None and child.conn is not None:
                send(child.conn, {"exit": os.waitstatus_to_exitcode(status)})
                self.forget(child.conn)


def remove_home(socket_path: str) -> None:
    """Remove the socket, and its directory if nothing but an empty log is left there (the owner
    removes it when it stops the zygote, but an owner that was killed never does)."""
    home = os.path.dirname(socket_path)
    log = os.path.join(home, LOG)
    for path in (socket_path, *([log] if _empty(log) else [])):
        try:
            os.unlink(path)
        except OSError:
            pass
    try:
        os.rmdir(home)
    except OSError:
        pass  # something else is there (a log with something in it): left for a person to read


def _empty(path: str) -> bool:
    try:
        return os.path.getsize(path) == 0
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:  # 0 at once if the owner is gone, else never returns
    p = argparse.ArgumentParser(prog="python -m trainer.zygote")
    p.add_argument("--socket", required=True, help="unix socket path to serve on")
    p.add_argument("--owner", type=int, required=True, help="the zygote ends when this process (its parent) does")
    p.add_argument("--preload", default="", help="modules to import before serving, comma-separated")
    p.add_argument("--title-room", default="", help="padding: room in argv for the children's command lines")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if os.getppid() != args.owner:
        return 0  # the owner died before we started
    server = Server(args.socket, args.owner)
    for module in filter(None, args.preload.split(",")):
        try:
            importlib.import_module(module)
        except Exception as e:  # a child importing it will report it properly
            print(f"zygote: preloading {module} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    try:
        server.serve()
    finally:
        remove_home(args.socket)
    exit_now(0)  # the end of every campaign run waits for its zygote to exit: no module teardown (0.8 s)
