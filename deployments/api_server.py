"""The Prefect API server of one ``pretrain run``, when no Prefect server is configured.

Prefect's own ephemeral server (``SubprocessASGIServer``) is a plain child of the flow's process:
in the terminal's process group, so Ctrl-C kills it while the campaign still needs it to record
how it ended, and it outlives a ``pretrain run`` killed with SIGKILL. This one is started the
same way (uvicorn, ``prefect.server.api.server:create_app``, the same environment) but in a
session of its own, so terminal signals reach only the CLI, which stops it last; and it runs
under the same orphan watchdog as the node agents (``trainer.common.process.exit_when_orphaned``), so
it ends with its parent whatever killed that.

    python -m deployments.api_server --port P   # what the CLI starts; not for direct use
"""

from __future__ import annotations

import argparse
import inspect
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from pretrain.cluster.ports import free_port
from pretrain.run.stop import StoppedAtOnce
from trainer.common.process import child_env, exit_now, exit_when_orphaned, pid_alive

HOST = "127.0.0.1"
# a local server for one run: no UI, and no telemetry heartbeat (its write raced the first start's
# migrations on a fresh database: "database is locked", a traceback); a user's setting still wins
SERVER_ENV = {
    "PREFECT_UI_ENABLED": "0",
    "PREFECT__SERVER_EPHEMERAL": "1",
    "PREFECT__SERVER_FINAL": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}
LOG_PREFIX = "pretrain-api-server-"  # + the CLI's pid + .log, in Prefect's home
LOG_TAIL_LINES = 15
STOP_TIMEOUT_S = 10.0
MAX_RESTARTS = 5  # a server that keeps dying after this many restarts is left down (the run then fails)


class ApiServerError(RuntimeError):
    """The local Prefect API server did not start."""


def sweep_empty_logs(log_dir: Path) -> None:
    """Remove the empty logs of runs that are gone (a CLI killed with SIGKILL never removed its
    own); a log that holds something stays: it may say why a run failed."""
    for path in log_dir.glob(f"{LOG_PREFIX}*.log"):
        pid = path.name[len(LOG_PREFIX) : -len(".log")]
        try:
            if not pid.isdigit() or path.stat().st_size or pid_alive(int(pid)):
                continue
            path.unlink()
        except OSError:  # another run swept it first
            pass


class ApiServer:
    """One server process; ``start()`` returns its API URL once ``/api/health`` answers. What the
    server prints goes to ``log_path`` (in ``log_dir``, Prefect's home by default), not to the
    user's terminal: a failed start names it and shows its end; a clean stop removes it if empty."""

    def __init__(self, log_dir: Path | None = None) -> None:
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.port: int | None = None
        self.log_dir = log_dir
        self.log_path: Path | None = None
        self.restarts = 0
        self._watching = False
        self.keeper: threading.Thread | None = None
        self._lock = threading.Lock()  # a restart and ``stop`` never interleave

    def start(self, timeout_s: float, attempts: int = 3) -> str:
        """Launch the server and wait until it answers; its API URL."""
        self.launch()
        return self.wait_ready(timeout_s, attempts)

    def launch(self, port: int | None = None) -> None:
        """Start the server process and return at once (the caller may do other work meanwhile:
        the server takes seconds to answer); ``wait_ready`` waits for it. ``port``: a restart's
        (the same URL, its log appended to), else a free one."""
        from prefect.settings import get_current_settings

        settings = get_current_settings()
        env = child_env({**os.environ, **SERVER_ENV, **settings.to_environment_variables(exclude_unset=True)})
        log_dir = Path(self.log_dir or settings.home)
        log_dir.mkdir(parents=True, exist_ok=True)
        if port is None:
            sweep_empty_logs(log_dir)
        self.log_path = log_dir / f"{LOG_PREFIX}{os.getpid()}.log"
        self.port = port or free_port()
        with open(self.log_path, "ab" if port else "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "deployments.api_server", "--port", str(self.port)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.url = f"http://{HOST}:{self.port}/api"

    def keep_alive(self, notice: Callable[[str], None], timeout_s: float) -> None:
        """Restart the server on its port whenever it exits before ``stop`` (killed, out of memory),
        up to ``MAX_RESTARTS`` times: Prefect's clients retry a refused connection for about a
        minute, so the run goes on as if nothing happened. ``notice`` tells the user."""
        self._watching = True
        self.keeper = threading.Thread(
            target=self._watch, args=(notice, timeout_s), name="api-server-keeper", daemon=True
        )
        self.keeper.start()

    def _watch(self, notice: Callable[[str], None], timeout_s: float) -> None:
        while (proc := self.proc) is not None:
            code = proc.wait()
            with self._lock:
                if not self._watching or self.proc is not proc:
                    return
                if self.restarts >= MAX_RESTARTS:
                    notice(
                        f"the local Prefect API server exited ({_exit_cause(code)}) after {self.restarts} restart(s): "
                        f"not restarting it again; training goes on, the run fails at its next state change. Its "
                        f"log: {self.log_path}"
                    )
                    return
                self.restarts += 1
                notice(
                    f"the local Prefect API server exited ({_exit_cause(code)}): restarting it on port {self.port}; "
                    "the run goes on (its log: " + str(self.log_path) + ")"
                )
                self.launch(self.port)
            if self._healthy(timeout_s):
                notice("the local Prefect API server is back")
            elif (proc := self.proc) is not None and proc.poll() is None:
                proc.kill()  # not answering: the next round restarts it

    def wait_ready(self, timeout_s: float, attempts: int = 3) -> str:
        """The API URL once the launched server answers; a server that exits or does not answer
        within ``timeout_s`` is stopped and another launched (a port taken between choosing and
        binding), up to ``attempts`` in all."""
        for _ in range(attempts):
            if self.proc is None:
                self.launch()
            if self._healthy(timeout_s):
                return self.url
            self.stop(keep_log=True)
        raise ApiServerError(
            f"the local Prefect API server did not start within {timeout_s:.0f}s; "
            "on a busy machine give it longer (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120), or start "
            f"one (`prefect server start`) and set PREFECT_API_URL to use it. {self._log_tail()}"
        )

    def _log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        if not lines:
            return f"It printed nothing (log: {self.log_path})."
        return f"The end of its log ({self.log_path}):\n" + "\n".join(lines[-LOG_TAIL_LINES:])

    def _healthy(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2) as client:
            while time.monotonic() < deadline and (proc := self.proc) is not None and proc.poll() is None:
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return True
                except httpx.TransportError:
                    pass
                time.sleep(0.1)  # polls the server's health endpoint until it answers
        return False

    def stop(self, timeout_s: float = STOP_TIMEOUT_S, keep_log: bool = False) -> None:
        """SIGTERM (uvicorn shuts down cleanly), then SIGKILL to its whole group (idempotent); its
        log goes unless ``keep_log`` or it holds something."""
        with self._lock:
            self._watching = False
            proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        if not keep_log and self.log_path is not None and self.log_path.exists() and not self.log_path.stat().st_size:
            self.log_path.unlink(missing_ok=True)


def _exit_cause(code: int) -> str:
    return (
        f"killed by {signal.Signals(-code).name}"
        if code < 0 and -code in signal.valid_signals()
        else f"exit code {code}"
    )


def drain_prefect_workers() -> None:
    """Send the logs and events still queued in this process, while the server is up (as
    ``prefect_test_harness`` does before stopping its server)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def drain() -> None:
        try:
            result = APILogWorker.instance().drain()
            if inspect.isawaitable(result):
                await result
        except RuntimeError:  # never started
            pass
        result = EventsWorker.drain_all()
        if inspect.isawaitable(result):
            await result

    run_coro_as_sync(drain())


@contextmanager
def _prefect_queues_drained() -> Iterator[None]:
    """Send what the block queued to the API before it returns or raises, so that nothing of
    Prefect's (``EventsWorker - Still processing items``) prints at exit after the CLI's last line;
    not on ``StoppedAtOnce``: the flow may still be logging, and waiting would not stop at once."""
    try:
        yield
    except StoppedAtOnce:
        raise
    except BaseException:
        drain_prefect_workers()
        raise
    drain_prefect_workers()


@contextmanager
def api_server_for_this_run(
    while_starting: Callable[[], object] | None = None, notice: Callable[[str], None] | None = None
) -> Iterator[ApiServer | None]:
    """Point Prefect at a server owned by this process for the block, if Prefect would otherwise
    start its ephemeral one; a configured ``PREFECT_API_URL`` is used as it is (yields None). The
    logs and events the block queued are sent before it ends, while the server is up.
    ``while_starting`` (e.g. importing the flow, ~5 s) runs while the server starts (~6 s).
    ``notice`` (default: stderr) says that it starts (the seconds before the flow's first line),
    and when a server that exited meanwhile is restarted on its port."""
    from prefect.context import _temporary_global_settings_context, get_settings_context
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, get_current_settings, temporary_settings

    settings = get_current_settings()
    if settings.api.url or not settings.server.ephemeral.enabled:
        if while_starting is not None:
            while_starting()
        with _prefect_queues_drained():
            yield None
        return
    notice = notice or (lambda msg: print(msg, file=sys.stderr, flush=True))
    notice(
        "starting a local Prefect API server for this run (a few seconds; set PREFECT_API_URL to use a Prefect "
        "server of yours)"
    )
    server = ApiServer()
    try:
        server.launch()
        if while_starting is not None:
            while_starting()
        url = server.wait_ready(settings.server.ephemeral.startup_timeout_seconds)
        server.keep_alive(notice, settings.server.ephemeral.startup_timeout_seconds)
        # this context and the process-global one: Prefect's log and event workers run in
        # threads of their own, which see the global settings. No UI URL: this server serves
        # none, and Prefect would print a "View at <url>" for each flow run that answers 404
        with (
            temporary_settings(updates={PREFECT_API_URL: url, PREFECT_UI_URL: ""}),
            _temporary_global_settings_context(get_settings_context()),
            _prefect_queues_drained(),
        ):
            yield server
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.api_server")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    exit_when_orphaned()  # the CLI that owns this server is gone: so is the reason to serve
    import uvicorn

    uvicorn.run(
        "prefect.server.api.server:create_app",
        factory=True,
        host=HOST,
        port=args.port,
        log_level="error",
        lifespan="on",
    )
    return 0


if __name__ == "__main__":
    exit_now(main())  # whoever started it waits for the exit: no module teardown
