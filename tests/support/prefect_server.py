"""A real ``prefect server start`` on 127.0.0.1 (free port, its own PREFECT_HOME and database) and
process workers for it, for the tests that need what the test harness does not give: the
server's event triggers, deployments run by a worker, cancellation through the API.

Bind the fixtures in a test module (``prefect_server = prefect_server.prefect_server``) or
use them from conftest.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from support.s3_servers import _Server, free_ports

ROOT = Path(__file__).resolve().parents[2]


class PrefectServer(_Server):
    name = "prefect server"

    def __init__(self, home: Path, database: Path | None = None):
        """``database``: a migrated, empty server database to start from (copied; the server
        migrates a new one on start, seconds of CPU)."""
        self.home, self.database = home, database
        self.log_path = home / "server.log"
        self.workers: list[subprocess.Popen] = []
        self._pick_port()

    def _pick_port(self) -> None:
        self.port = free_ports(1)[0]
        self.api_url = self.endpoint = f"http://127.0.0.1:{self.port}/api"

    def env(self, **extra: str) -> dict[str, str]:
        """Environment of a client process (CLI, worker) of this server; flow runs inherit it, and
        PYTHONPATH makes them import this checkout."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update(
            PREFECT_HOME=str(self.home),
            PREFECT_API_URL=self.api_url,
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        )
        env.update(extra)
        return env

    def start(self, timeout: float = 120, attempts: int = 3) -> PrefectServer:
        """Start the server and wait for ``/api/health``; a port taken between picking it and
        binding it (other processes share this machine) means another try on a new port."""
        self.home.mkdir(parents=True, exist_ok=True)
        if self.database is not None and not (self.home / "prefect.db").exists():  # the default database's place
            shutil.copyfile(self.database, self.home / "prefect.db")
        env = self.env(PREFECT_UI_ENABLED="false", PREFECT_SERVER_LOGGING_LEVEL="WARNING")
        env.pop("PREFECT_API_URL")

        def probe() -> None:
            httpx.get(f"{self.api_url}/health", timeout=2).raise_for_status()

        for attempt in range(attempts):
            self._spawn(
                [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
                env,
            )
            try:
                self._wait_ready(probe, timeout)
                return self
            except RuntimeError:
                if attempt + 1 == attempts or "address already in use" not in self.log_path.read_text(errors="replace"):
                    raise
                self.log_path.rename(self.log_path.with_suffix(f".attempt{attempt}.log"))
                self._pick_port()
        return self

    def start_worker(self, pool: str, log: Path, *extra: str) -> subprocess.Popen:
        """``prefect worker start --pool POOL --type process`` polling every second, run from the checkout."""
        out = open(log, "ab")  # noqa: SIM115 - the worker writes to it while it runs
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process", *extra],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=self.env(PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_PREFETCH_SECONDS="5"),
        )
        out.close()
        self.workers.append(proc)
        return proc

    def prefect(self, *args: str, timeout: float = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess:
        """Run the ``prefect`` CLI against this server."""
        return subprocess.run(
            [sys.executable, "-m", "prefect", *args],
            cwd=cwd,
            env=self.env(PWD=str(cwd)),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    @contextlib.contextmanager
    def settings(self):
        """Point this process's Prefect client at the server for the duration of the block."""
        from prefect.events.worker import EventsWorker
        from prefect.settings import PREFECT_API_URL, temporary_settings

        # the events worker is a process-wide service bound to the API it first talked to:
        # drain it on the way in and out, so events go to the server the settings name
        EventsWorker.drain_all()
        with temporary_settings({PREFECT_API_URL: self.api_url}):
            try:
                yield self
            finally:
                EventsWorker.drain_all()

    def stop(self, timeout: float = 10) -> None:
        for w in self.workers:
            if w.poll() is None:
                w.terminate()
                try:
                    w.wait(timeout)
                except subprocess.TimeoutExpired:
                    w.kill()
        super().stop(timeout)

    def kill(self) -> None:
        """SIGKILL the workers (their process groups: the flow runs they started) and the server."""
        for w in self.workers:
            if w.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(w.pid, signal.SIGKILL)
                w.wait()
        super().kill()


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory, migrated_prefect_database):
    """One real Prefect server for the test session, started only if a test asks for it; killed at
    the end (its database is thrown away: a graceful stop waited up to 10 s for open connections)."""
    server = PrefectServer(tmp_path_factory.mktemp("prefect-home"), migrated_prefect_database).start()
    yield server
    server.kill()


@pytest.fixture
def on_prefect_server(prefect_server):
    """The test's Prefect client talks to the real server."""
    with prefect_server.settings():
        yield prefect_server
