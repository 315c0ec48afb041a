"""A fork server with torch imported: every process we start would otherwise pay ``import torch``
(~2 CPU-s) before doing anything — node agents, node checks, gate passes.

``Zygote.start(preload=[...])`` starts ``python -m trainer.zygote`` (the server:
``trainer.zygote.server``) and returns at once; ``zygote.spawn(module, argv, env=…, stdout=…)``
asks it to fork a child that runs ``python -m module argv`` as ``__main__`` with exactly the
environment, working directory, standard streams and session asked for, and returns a Popen-like
:class:`ZygoteProcess` (``trainer.zygote.process``; the request and its reply:
``trainer.zygote.fork``). Another process (a node agent) can use the same server:
``Zygote.connect(path)`` with the :attr:`Zygote.path` it was given in argv.

Whatever the main module of the calling process (``pretrain run``, a Prefect worker's flow
process), unlike multiprocessing's fork server. A zygote that cannot start or dies: every later
start is a plain ``subprocess.Popen`` of a fresh interpreter (said once through ``log``), never a
failed job. A child's reason to live is its client: it gets SIGTERM when the connection that asked
for it closes (its client died, or dropped the handle: keep it while the child should run), and
when the zygote's owner dies; a zygote killed takes its children with it (their parent is gone,
as for any of our processes: ``trainer.common.process.exit_when_orphaned``).

One zygote per campaign run: :func:`zygote_running` starts it and makes it the context's
:func:`current_zygote` for the code that starts processes.
"""

from __future__ import annotations

import contextvars
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from trainer.common.process import PARENT_ENV, child_env
from trainer.zygote.fork import Stream, child_fds, fork_child, fork_request
from trainer.zygote.process import ZygoteProcess
from trainer.zygote.server import LOG

# torch._inductor.config: what torch.use_deterministic_algorithms imports (every CPU worker calls
# it): ~1 CPU-s in each forked worker, about two thirds of a small job's worker CPU, if not here
PRELOAD = ("torch", "torch._inductor.config", "trainer.launch", "trainer.worker", "trainer.nodecheck", "trainer.gate")
TITLE_ROOM = 4096  # bytes of the zygote's argv its children rewrite into their own command lines
READY_TIMEOUT_S = (
    120.0  # a zygote still importing when asked: wait this long (a fresh interpreter pays the same imports)
)


class Zygote:
    """A client of one zygote (see the module's docstring); owns the server when it started it."""

    def __init__(
        self,
        path: str,
        server: subprocess.Popen | None = None,
        log: Callable[[str], None] | None = None,
        python: str = sys.executable,
        ready_timeout_s: float = READY_TIMEOUT_S,
        why_not: str | None = None,
    ):
        self.path, self.python, self.ready_timeout_s = path, python, ready_timeout_s
        self._server = server
        self._log = log or (lambda message: print(message, file=sys.stderr, flush=True))
        self._why_not = why_not  # set once it is unusable: every start is a Popen from then on
        self._lock = threading.Lock()

    @classmethod
    def start(
        cls,
        preload: Sequence[str] = PRELOAD,
        env: Mapping[str, str] | None = None,
        log: Callable[[str], None] | None = None,
        python: str = sys.executable,
        ready_timeout_s: float = READY_TIMEOUT_S,
    ) -> Zygote:
        """Start a zygote owned by this process (it ends when this process does); returns at
        once, the imports run meanwhile. ``env``: the server's environment (what its imports
        read; default this process's); each child gets the environment its request gives."""
        home = tempfile.mkdtemp(prefix="zygote-")
        path = os.path.join(home, "socket")
        try:
            with open(os.path.join(home, LOG), "wb") as err:
                server = subprocess.Popen(
                    [
                        python,
                        "-m",
                        "trainer.zygote",
                        "--socket",
                        path,
                        "--owner",
                        str(os.getpid()),
                        "--preload",
                        ",".join(preload),
                        "--title-room",
                        "." * TITLE_ROOM,
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    start_new_session=True,
                    env=None if env is None else dict(env),
                )
        except OSError as e:
            return cls(path, None, log, python, ready_timeout_s, why_not=f"it could not start ({e})")
        return cls(path, server, log, python, ready_timeout_s)

    @classmethod
    def connect(cls, path: str, log: Callable[[str], None] | None = None) -> Zygote:
        """A client of a zygote another process started (e.g. a node agent given ``--zygote PATH``)."""
        return cls(path, None, log)

    @property
    def usable(self) -> bool:
        return self._why_not is None

    def spawn(
        self,
        module: str,
        argv: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        stdin: Stream = None,
        stdout: Stream = None,
        stderr: Stream = None,
        new_session: bool = False,
    ) -> ZygoteProcess | subprocess.Popen:
        """Start ``python -m module argv`` (forked from the zygote; a fresh interpreter if the
        zygote is unusable). ``env``: the child's complete environment (default: this
        process's now); ``stderr`` may be ``subprocess.STDOUT``."""
        env = dict(os.environ if env is None else env)
        env.pop(PARENT_ENV, None)  # a forked child's parent is the zygote
        args = [self.python, "-m", module, *map(str, argv)]
        if self._why_not is None:
            try:
                request = fork_request(module, argv, env, args, cwd, new_session)
                return fork_child(
                    self.path, self._server, self.ready_timeout_s, args, request, child_fds((stdin, stdout, stderr))
                )
            except (OSError, ValueError, ConnectionError, TimeoutError) as e:
                self._unusable(f"{type(e).__name__}: {e}")
        return subprocess.Popen(
            args, env=child_env(env), cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, start_new_session=new_session
        )

    def _unusable(self, why: str) -> None:
        with self._lock:
            if self._why_not is not None:
                return
            self._why_not = why
            if self._server is not None:
                if self._server.poll() is None:
                    self._server.kill()  # stuck: never let it fork a request we have given up on
                self._server.wait()
                why += self._server_log()
        self._log(
            f"the zygote (fork server) is unusable ({why}); starting processes with a fresh interpreter from now on"
        )

    def _server_log(self) -> str:
        try:
            tail = Path(self.path).with_name(LOG).read_text(errors="replace").strip().splitlines()[-3:]
        except OSError:
            return ""
        return f"; its log ends: {' | '.join(tail)}" if tail else ""

    def close(self) -> None:
        """Stop the zygote this client started (its children get SIGTERM) and remove its socket."""
        if self._server is not None and self._server.poll() is None:
            self._server.terminate()
            try:
                self._server.wait(10)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
        if self._server is not None:
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_CURRENT: contextvars.ContextVar[Zygote | None] = contextvars.ContextVar("trainer_zygote", default=None)


def current_zygote() -> Zygote | None:
    """The zygote of the campaign run this code runs under, if any."""
    return _CURRENT.get()


@contextmanager
def zygote_running(
    preload: Sequence[str] = PRELOAD, env: Mapping[str, str] | None = None, log: Callable[[str], None] | None = None
) -> Iterator[Zygote]:
    """A zygote for the block, the context's :func:`current_zygote` (code run in a context copied
    inside the block sees it: Prefect's task threads do); stopped at the block's end. Inside a
    block that has a usable zygote already (a process that keeps one warm for the campaigns it
    runs one after another, as the test suite does), that one serves and is left running."""
    enclosing = _CURRENT.get()
    if enclosing is not None and enclosing.usable:
        yield enclosing
        return
    zygote = Zygote.start(preload, env, log)
    token = _CURRENT.set(zygote)
    try:
        yield zygote
    finally:
        _CURRENT.reset(token)
        zygote.close()


def spawn(
    module: str,
    argv: Sequence[str] = (),
    *,
    zygote: Zygote | None = None,
    python: str = sys.executable,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    stdin: Stream = None,
    stdout: Stream = None,
    stderr: Stream = None,
    new_session: bool = False,
) -> ZygoteProcess | subprocess.Popen:
    """``python -m module argv``: forked from ``zygote`` when given, else a fresh interpreter."""
    if zygote is not None:
        return zygote.spawn(
            module, argv, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, new_session=new_session
        )
    return subprocess.Popen(
        [python, "-m", module, *map(str, argv)],
        env=child_env(env),
        cwd=cwd,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        start_new_session=new_session,
    )
