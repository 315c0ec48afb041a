"""The Prefect API server one ``pretrain run`` owns when no server is configured: what it prints
goes to its own log, not to the user's terminal; a failed start says why from that log."""

from __future__ import annotations

import pytest

from deployments.api_server import ApiServer, ApiServerError


def test_a_server_that_cannot_start_is_reported_with_the_end_of_its_log_and_the_terminal_stays_clean(
        tmp_path, capfd):
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL, temporary_settings

    server = ApiServer(log_dir=tmp_path / "logs")
    with temporary_settings(updates={PREFECT_API_DATABASE_CONNECTION_URL:
                                     f"sqlite+aiosqlite:///{tmp_path}/no/such/dir/prefect.db"}):
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
