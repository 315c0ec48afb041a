"""How ``pretrain data prepare`` runs the ``prepare-data`` flow in its own process: the same flow
a campaign runs (lock, ledger record, progress artifact, MLflow input), against this process's
own Prefect API server when none is configured, with the CLI's progress display attached."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from deployments.api_server import api_server_for_this_run
from pretrain.dataset.progress import ProgressCallback
from pretrain.spec import CampaignSpec


class _MessageOnly(logging.Formatter):
    """The console shows what failed in one line; Prefect's API logs keep the tracebacks."""

    def __init__(self, inner: logging.Formatter | None):
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info:
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        return self.inner.format(record)


@contextmanager
def _console_without_tracebacks() -> Iterator[None]:
    from prefect.logging.handlers import PrefectConsoleHandler

    handlers = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    formatters = [h.formatter for h in handlers]
    for h in handlers:
        h.setFormatter(_MessageOnly(h.formatter))
    try:
        yield
    finally:
        for h, f in zip(handlers, formatters):
            h.setFormatter(f)


def prepare_data_here(spec: CampaignSpec, progress: ProgressCallback | None = None) -> dict:
    """Prepare (or reuse) the campaign's data set in this process; returns the flow's summary.
    Raises what the flow raised (a bad data section, a busy campaign, Ctrl-C)."""
    with api_server_for_this_run(while_starting=lambda: importlib.import_module("flows.prepare_data")), \
            _console_without_tracebacks():
        from flows.prepare_data import prepare_data

        return prepare_data(spec=spec, progress=progress)
