"""The Prefect API going away while a stage trains (a server restarting, a network cut) never
stops training: the job, the gate's tasks and the stage's loop go on without it, and the
campaign completes once it answers again. The outage is a proxy in front of the test's real
server switched off and on (tests/support/tcp_proxy.py). Prefect's client retries once instead of five
times (~2 s instead of about a minute of backoff) and the stage polls its job every 0.5 s, so
a few seconds of outage show what a longer one does. On ``pretrain run``'s console Prefect's own
notes of the outage show once a minute (table-driven)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest
from test_resume import SLOW_MODEL

from deployments.console import OutageNotes, quiet_console
from flows.campaign import pretrain_campaign
from pretrain.run.jobs import checkpoint_store
from pretrain.state.ledger import Ledger
from support.campaigns import seed_data, small_spec, wait_for
from support.tcp_proxy import SwitchableProxy

STEPS = 80  # 50–100 ms a step
AWAY_AFTER_THE_JOB_S = 10.0  # longer than the stage flow run's end takes to fail without the API (~5 s, one retry)


def test_a_prefect_api_away_mid_stage_never_stops_training(prefect_harness, prepared_data, tmp_path, monkeypatch):
    """The API goes away at the stage's first checkpoint and stays away past its job's end: the
    job trains to its last step, and the stage waits for the API before its flow run ends."""
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    spec = small_spec(
        tmp_path,
        model=SLOW_MODEL,
        checkpoint={"interval": 10, "memory_interval": 5, "keep": 3},
        stages=[{"name": "main", "steps": STEPS, "seq_len": 64, "micro_batch": 8, "warmup_steps": 5}],
    )
    seed_data(spec, prepared_data)
    monkeypatch.setenv("PRETRAIN_GATE_POLL_S", "0.5")
    server = urlsplit(PREFECT_API_URL.value())
    proxy = SwitchableProxy((server.hostname, server.port))
    store = checkpoint_store(spec, "main")

    def job_ended() -> bool:  # the stage recorded its job's end: what follows is the stage flow run's own end
        return any(s.kind == "job" and s.end is not None for s in Ledger.read(spec.layout).record.spans)

    try:
        with (
            temporary_settings({PREFECT_API_URL: f"{proxy.url}{server.path}", PREFECT_CLIENT_MAX_RETRIES: 1}),
            ThreadPoolExecutor(1) as pool,
        ):
            run = pool.submit(contextvars.copy_context().run, pretrain_campaign, spec=spec)
            away_from = wait_for(lambda: store.read_pointer() or run.done(), 240, "the first checkpoint")
            proxy.down()
            wait_for(lambda: job_ended() or run.done(), 120, "the job's end while the API is away")
            trained_while_away = (store.read_pointer() or 0) - away_from
            time.sleep(AWAY_AFTER_THE_JOB_S)  # the outage's length past the job's end (the fault, not a wait)
            waiting = not run.done()  # the stage waits for the API; it did not fail
            proxy.up()
            status = run.result(timeout=300)
    finally:
        proxy.close()
    [stage] = status["stages"]
    assert waiting and trained_while_away > 0
    assert (status["status"], stage["status"], stage["attempts"], stage["failures"]) == (
        "completed",
        "completed",
        1,
        [],
    )
    assert stage["good_checkpoint"]["step"] == STEPS and stage["bad_checkpoints"] == []


def _record(name: str, message: str, level=logging.WARNING) -> logging.LogRecord:
    return logging.makeLogRecord({"name": name, "msg": message, "levelno": level})


RECONNECT = ("prefect.events.clients", "Unable to connect to 'ws://127.0.0.1:4200/api/events/in'. Please check ...")
DROPPED = (
    "prefect._internal.concurrency",
    "Service 'EventsWorker' failed to process item Event(occurred=..., "
    "event='pretrain.checkpoint.good', resource=... 3 kB of it ...)",
)


@pytest.mark.parametrize(
    "notes, shown",
    [  # (seconds since the outage began, logger and message) → shown?
        ([(0, RECONNECT), (7, RECONNECT), (14, RECONNECT)], [True, False, False]),  # every ~7 s: once
        ([(0, RECONNECT), (61, RECONNECT)], [True, True]),  # and again after a minute
        ([(0, RECONNECT), (1, DROPPED), (2, DROPPED)], [True, True, False]),  # each kind once
    ],
)
def test_prefect_s_outage_notes_show_once_a_minute(notes, shown):
    now = [0.0]
    notes_filter = OutageNotes(clock=lambda: now[0])
    seen = []
    for at, (name, message) in notes:
        now[0] = at
        record = _record(name, message)
        seen.append(notes_filter.filter(record))
        if name.endswith("concurrency"):
            assert "Event(" not in record.getMessage() and "dropped an event" in record.getMessage()
    assert seen == shown


def test_pretrain_run_s_console_shows_the_outage_notes_once_and_the_campaign_s_own_lines_all():
    seen: list[str] = []
    shown = logging.Handler()
    shown.emit = lambda record: seen.append(record.getMessage())
    loggers = [logging.getLogger(name) for name in (RECONNECT[0], DROPPED[0], "pretrain.test")]
    for logger in loggers:
        logger.addHandler(shown)
    try:
        with quiet_console():
            for _ in range(3):
                logging.getLogger(RECONNECT[0]).warning(RECONNECT[1])
                logging.getLogger(DROPPED[0]).error(DROPPED[1])
                logging.getLogger("pretrain.test").warning("stage main: checkpoint 40 is good")
        logging.getLogger(DROPPED[0]).error(DROPPED[1])  # after the run: as Prefect logs it
    finally:
        for logger in loggers:
            logger.removeHandler(shown)
    assert [m[:24] for m in seen] == [
        "Unable to connect to 'ws",
        "Prefect's events worker ",
        "stage main: checkpoint 4",
        "stage main: checkpoint 4",
        "stage main: checkpoint 4",
        DROPPED[1][:24],
    ]


class _Unreachable:
    async def request(self, *args, **kwargs):
        raise OSError("All connection attempts failed")


def test_prefect_s_api_log_batches_failing_print_nothing_on_pretrain_run_s_console(capfd):
    """Prefect's API log worker writes "--- Error logging to API ---" and the error to stderr for
    each batch it could not send (every ~2 s while its API is away): not on ``pretrain run``'s
    console, whose outage notes say so once a minute; outside it, as Prefect does."""
    from prefect.logging.handlers import APILogWorker

    worker = APILogWorker.__new__(APILogWorker)  # its batch sender alone, with a client that cannot connect
    worker._client = _Unreachable()
    with quiet_console():
        asyncio.run(worker._handle_batch([b"{}"]))
    assert capfd.readouterr().err == ""
    asyncio.run(worker._handle_batch([b"{}"]))
    assert "--- Error logging to API ---" in capfd.readouterr().err
