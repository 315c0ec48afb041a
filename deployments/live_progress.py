"""``pretrain run``'s console while a stage trains: the training display of ``pretrain.views.follow``
(a rich bar on a terminal, a line every ``progress_interval_s`` otherwise), fed from the workdir
by a thread of this process.

The training task also logs those numbers (for the flow run's log in the Prefect API); on this
console they would say it twice, so Prefect's console handler drops them while the display runs.
On a terminal the handler prints through the bar's console, so log lines scroll above the bar
instead of tearing it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pretrain.console_progress import progress_display
from pretrain.settings import PretrainSettings
from pretrain.views.follow import TITLE, FollowThread
from pretrain.views.training_progress import PROGRESS_RECORD


def _not_progress(record: logging.LogRecord) -> bool:
    return not getattr(record, PROGRESS_RECORD, False)


@contextmanager
def training_display(workdir: Path, settings: PretrainSettings | None = None) -> Iterator[None]:
    """Show the campaign's training progress on stderr for the duration of the block."""
    from prefect.logging.configuration import ensure_logging_setup
    from prefect.logging.handlers import PrefectConsoleHandler

    settings = settings or PretrainSettings.from_env()
    ensure_logging_setup()
    display = progress_display(TITLE, interval_s=settings.progress_interval_s, estimates=False)
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    consoles = [h.console for h in handlers]
    for h in handlers:
        h.addFilter(_not_progress)
        h.console = getattr(display, "console", h.console)  # a bar: print above it
    follow = FollowThread(workdir, display).start()
    try:
        yield
    finally:
        follow.close()
        for h, console in zip(handlers, consoles):
            h.removeFilter(_not_progress)
            h.console = console
