"""What ``pretrain run`` and ``pretrain data prepare`` show of Prefect's logs on the console.

Prefect logs the exception of every task and flow run it ends with its traceback. The CLI says
what failed and what to do in its own last lines (a stage that failed for good, a refused
workdir, an operator's stop), so on the console each such record shows its message only; the
tracebacks stay in the flow run's logs (the Prefect UI, ``prefect flow-run logs ID``), and
``PREFECT_LOGGING_LEVEL=DEBUG`` shows them on the console too. MLflow's notes about its own
bookkeeping when it creates a sqlite store ("Creating initial MLflow database tables...") are left
out as well; its warnings and errors show.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from pretrain.interrupt import StoppedAtOnce
from pretrain.log_levels import loggers_at

STORE_SETUP_LOGGERS = ("mlflow.store.db.utils",)  # INFO lines while MLflow creates or upgrades its tables
# a WARNING per retry of MLflow's HTTP client ("Retrying (Retry(total=6, ...)) after connection broken
# by ..."): the campaign's own lines say that MLflow is away and what happens meanwhile
RETRY_LOGGERS = ("urllib3.connectionpool",)


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
    and its HTTP client's retry notes are not shown. The handlers are left so on ``StoppedAtOnce``: the flow thread goes on logging
    until the process exits."""
    with loggers_at(logging.WARNING, STORE_SETUP_LOGGERS), loggers_at(logging.ERROR, RETRY_LOGGERS):
        with _messages_only():
            yield


@contextmanager
def _messages_only() -> Iterator[None]:
    from prefect.logging.handlers import PrefectConsoleHandler

    handlers = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    formatters = [h.formatter for h in handlers]
    for h in handlers:
        h.setFormatter(MessageOnly(h.formatter))
    try:
        yield
    except StoppedAtOnce:
        raise
    except BaseException:
        _restore(handlers, formatters)
        raise
    _restore(handlers, formatters)


def _restore(handlers: list[logging.Handler], formatters: list[logging.Formatter | None]) -> None:
    for h, f in zip(handlers, formatters):
        h.setFormatter(f)
