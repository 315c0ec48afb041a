"""Exponential backoff between tries of something that keeps failing (a tracking service, a
checkpoint saver): ``initial_s``, doubling with each failure in a row, up to ``max_s``."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Backoff:
    initial_s: float
    max_s: float
    failures: int = 0  # in a row
    next_at: float = 0.0  # time.monotonic() of the next try

    def due(self) -> bool:
        return time.monotonic() >= self.next_at

    def failed(self) -> float:
        """Count a failure; returns the delay until the next try."""
        self.failures += 1
        delay = min(self.max_s, self.initial_s * 2 ** (self.failures - 1))
        self.next_at = time.monotonic() + delay
        return delay

    def succeeded(self) -> None:
        self.failures, self.next_at = 0, 0.0
