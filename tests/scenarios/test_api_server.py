"""The Prefect API server one ``pretrain run`` owns when no server is configured: what it prints
goes to its own log, not to the user's terminal; a failed start says why from that log."""

from __future__ import annotations

import os
import signal

import pytest

from deployments.api_server import ApiServer, ApiServerError
from support.campaigns import wait_for


def test_a_server_that_cannot_start_is_reported_with_the_end_of_its_log_and_the_terminal_stays_clean(tmp_path, capfd):
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL, temporary_settings

    server = ApiServer(log_dir=tmp_path / "logs")
    with temporary_settings(
        updates={PREFECT_API_DATABASE_CONNECTION_URL: f"sqlite+aiosqlite:///{tmp_path}/no/such/dir/prefect.db"}
    ):
        with pytest.raises(ApiServerError) as raised:
            server.start(timeout_s=60, attempts=1)
    message = str(raised.value)
    assert str(server.log_path) in message and "PREFECT_API_URL" in message  # where to look, what to do
    assert "unable to open database file" in message  # the server's own reason, from its log
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err  # the server's traceback stayed in its log
    assert "Traceback" in server.log_path.read_text()


def test_a_server_that_ran_cleanly_leaves_no_log_behind(tmp_path, capfd):
    server = ApiServer(log_dir=tmp_path)
    server.start(timeout_s=60)
    assert server.log_path.exists()
    server.stop()
    assert list(tmp_path.iterdir()) == []
    out, err = capfd.readouterr()
    assert out + err == ""


def test_a_server_killed_under_a_run_is_restarted_on_its_port_and_prefect_s_client_carries_on(tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    server = ApiServer(log_dir=tmp_path)
    url = server.start(timeout_s=60)
    notices: list[str] = []
    server.keep_alive(notices.append, 60)
    first = server.proc
    try:
        with temporary_settings(updates={PREFECT_API_URL: url}), get_client(sync_client=True) as client:
            before = client.hello().status_code
            os.kill(first.pid, signal.SIGKILL)  # killed mid-run: OOM killer, a stray `pkill python`
            after = client.hello().status_code  # retried until the restarted server answers
        assert before == after == 200
        wait_for(lambda: "the local Prefect API server is back" in notices, 60, "the restart's notice")
        assert server.url == url and server.proc.pid != first.pid
        assert "exited (killed by SIGKILL): restarting it on port" in notices[0]
    finally:
        server.stop()
    server.keeper.join(30)
    assert not server.keeper.is_alive() and server.proc is None and server.restarts == 1  # a stop is not a death


def test_empty_logs_of_gone_runs_are_swept_and_others_kept(tmp_path):
    import subprocess
    import sys

    from deployments.api_server import LOG_PREFIX, sweep_empty_logs

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / f"{LOG_PREFIX}{gone.pid}.log").write_bytes(b"")  # a CLI killed with SIGKILL left it
    (tmp_path / f"{LOG_PREFIX}{gone.pid + 1000000}.log").write_text("ERROR why it failed\n")  # says something
    alive = tmp_path / f"{LOG_PREFIX}{os.getpid()}.log"  # a run still going
    alive.write_bytes(b"")
    (tmp_path / f"{LOG_PREFIX}x.log").write_bytes(b"")  # foreign name
    sweep_empty_logs(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{LOG_PREFIX}{gone.pid + 1000000}.log", alive.name, f"{LOG_PREFIX}x.log"]
    )
