"""What ``pretrain run`` and ``pretrain data prepare`` show of Prefect's logs on the console.

Prefect logs the exception of every task and flow run it ends with its traceback. The CLI says
what failed and what to do in its own last lines (a stage that failed for good, a refused
workdir, an operator's stop), so on the console each such record shows its message only; the
tracebacks stay in the flow run's logs (the Prefect UI, ``prefect flow-run logs ID``), and
``PREFECT_LOGGING_LEVEL=DEBUG`` shows them on the console too. MLflow's notes about its own
bookkeeping when it creates a sqlite store ("Creating initial MLflow database tables...") are left
out as well; its warnings and errors show. While the Prefect API is away, its background clients'
notes show once a minute (:class:`OutageNotes`), not every few seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from pretrain.log_levels import loggers_at
from pretrain.run.stop import StoppedAtOnce

STORE_SETUP_LOGGERS = ("mlflow.store.db.utils",)  # INFO lines while MLflow creates or upgrades its tables
# a WARNING per retry of MLflow's HTTP client ("Retrying (Retry(total=6, ...)) after connection broken
# by ..."): the campaign's own lines say that MLflow is away and what happens meanwhile
RETRY_LOGGERS = ("urllib3.connectionpool",)
# what Prefect's background clients log while its API is away: a WARNING every ~7 s from the events
# client's reconnects, an ERROR with a whole event's repr for each event the worker drops (its
# logger has a console handler of its own)
OUTAGE_LOGGERS = ("prefect.events.clients", "prefect._internal.concurrency")
REPEATS_S = 60.0
DROPPED_EVENT = "Service 'EventsWorker' failed to process item"


class OutageNotes(logging.Filter):
    """While the Prefect API is away: each of its background clients' notes once, then at most once
    a minute (``REPEATS_S``); a dropped event in one line instead of its repr."""

    def __init__(self, clock=time.monotonic):
        super().__init__()
        self.clock, self.shown = clock, {}

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(DROPPED_EVENT):
            record.msg, record.args = "Prefect's events worker dropped an event it could not send (the API is away)", ()
            message = record.msg
        key, now = (record.name, message[:60]), self.clock()
        if now - self.shown.get(key, -REPEATS_S) < REPEATS_S:
            return False
        self.shown[key] = now
        return True


class MessageOnly(logging.Formatter):
    """``inner``'s format, without the exception's traceback (unless Prefect logs at DEBUG)."""

    def __init__(self, inner: logging.Formatter | None):
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info and not logging.getLogger("prefect").isEnabledFor(logging.DEBUG):
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        return self.inner.format(record)


@contextmanager
def quiet_console() -> Iterator[None]:
    """For the block: Prefect's console handlers show messages only, MLflow's store setup notes
    and its HTTP client's retry notes are not shown. The handlers are left so on ``StoppedAtOnce``: the flow thread
    goes on logging until the process exits."""
    with loggers_at(logging.WARNING, STORE_SETUP_LOGGERS), loggers_at(logging.ERROR, RETRY_LOGGERS):
        with _handler_errors_unprinted(), _messages_only():
            yield


@contextmanager
def _handler_errors_unprinted() -> Iterator[None]:
    """A log handler's failure is not printed: stdlib's "--- Logging error ---" with a traceback,
    Prefect's "--- Error logging to API ---" per batch it could not send while its API is away
    (which the outage notes say once a minute); the console still shows every line. Left so on
    ``StoppedAtOnce``, as the handlers are."""
    before, logging.raiseExceptions = logging.raiseExceptions, False
    with _undone_unless_stopped_at_once(lambda: setattr(logging, "raiseExceptions", before)):
        yield


@contextmanager
def _messages_only() -> Iterator[None]:
    from prefect.logging.handlers import PrefectConsoleHandler

    handlers = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    formatters, notes = [h.formatter for h in handlers], OutageNotes()
    for h in handlers:
        h.setFormatter(MessageOnly(h.formatter))
    for name in OUTAGE_LOGGERS:
        logging.getLogger(name).addFilter(notes)
    with _undone_unless_stopped_at_once(lambda: _restore(handlers, formatters, notes)):
        yield


@contextmanager
def _undone_unless_stopped_at_once(undo) -> Iterator[None]:
    """``undo()`` when the block ends, unless it ends by ``StoppedAtOnce`` (the flow thread goes
    on logging until the process exits)."""
    try:
        yield
    except StoppedAtOnce:
        raise
    except BaseException:
        undo()
        raise
    undo()


def _restore(handlers: list[logging.Handler], formatters: list[logging.Formatter | None], notes: OutageNotes) -> None:
    for h, f in zip(handlers, formatters):
        h.setFormatter(f)
    for name in OUTAGE_LOGGERS:
        logging.getLogger(name).removeFilter(notes)
