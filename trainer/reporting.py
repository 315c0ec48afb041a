"""What a worker tells the orchestrator: append-only JSON lines in the job directory.

``metrics.jsonl`` (rank 0): one line per logged step. ``events.jsonl`` (every rank): start-up,
resume source, checkpoint commits, completion. The orchestrator tails both without importing
torch; lines are written whole and flushed, so a reader never sees half a record twice.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"


class JsonLines:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)

    def write(self, record: dict) -> None:
        line = json.dumps({"time": time.time(), "pid": os.getpid(), **record}, sort_keys=True)
        self._f.write(line + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_new_lines(path: str | Path, offset: int) -> tuple[list[dict], int]:
    """Complete JSON records after byte ``offset``, and the offset after the last one."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return [], offset
    end = chunk.rfind(b"\n") + 1
    records = [json.loads(line) for line in chunk[:end].splitlines() if line.strip()]
    return records, offset + end


def read_all(path: str | Path) -> list[dict]:
    return read_new_lines(path, 0)[0]
