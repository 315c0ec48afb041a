"""What data preparation reports while it works: one immutable snapshot per update, handed to a
``progress`` callback (a console bar, log lines, a Prefect progress artifact all read the same)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Phase = Literal["scan", "tokenizer", "tokenize", "assemble", "upload", "done"]


@dataclass(frozen=True)
class PrepProgress:
    """Where data preparation is; counts are cumulative for the run."""

    phase: Phase  # scan sources → train/load tokenizer → tokenize units → assemble shards → upload → done
    units_done: int = 0  # work units finished (reused ones count as done)
    units_total: int = 0
    bytes_done: int = 0  # source bytes of the finished units
    bytes_total: int = 0  # source bytes of every unit
    tokens: int = 0  # tokens written so far
    documents: int = 0  # documents kept so far

    @property
    def fraction(self) -> float:
        """Share of the work done, by source bytes (0..1)."""
        return 1.0 if self.phase == "done" else (self.bytes_done / self.bytes_total if self.bytes_total else 0.0)


ProgressCallback = Callable[[PrepProgress], None]
