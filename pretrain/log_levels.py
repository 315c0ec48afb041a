"""Loggers set to a level for the length of a block, then put back as they were."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager


@contextmanager
def loggers_at(level: int, names: Iterable[str]) -> Iterator[None]:
    """The loggers ``names`` at ``level`` inside the block; their own levels again after it,
    however it ends."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, old in zip(loggers, levels):
            lg.setLevel(old)
