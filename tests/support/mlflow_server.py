"""A real ``mlflow server`` on 127.0.0.1 (free port, sqlite store and artifacts in a test
directory) that a test can stop and start again on the same port and store: an outage of the
tracking service while training goes on."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import httpx

from support.s3_servers import _Server, free_ports


class MlflowServer(_Server):
    name = "mlflow server"

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.log_path = workdir / "mlflow-server.log"
        self.port = free_ports(1)[0]
        self.endpoint = self.uri = f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120, template: Path | None = None) -> MlflowServer:
        """Serve ``<workdir>/mlflow.db``; a new one starts as a copy of ``template`` (an empty
        migrated store: the server's own migrations of a new store take seconds)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        store = self.workdir / "mlflow.db"
        if template is not None and not store.exists():
            shutil.copyfile(template, store)
        # no job runner (MLflow 3 starts huey consumers for server-side jobs): nothing here uses them
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self._spawn(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{store}",
                "--artifacts-destination",
                str(self.workdir / "artifacts"),
            ],
            env,
        )
        self._wait_ready(lambda: httpx.get(f"{self.uri}/health", timeout=2).raise_for_status(), timeout)
        return self

    def down(self) -> bool:
        try:
            httpx.get(f"{self.uri}/health", timeout=2)
        except httpx.TransportError:
            return True
        return False
