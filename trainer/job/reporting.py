"""What a worker tells the orchestrator: append-only JSON lines in the job directory.

``metrics.jsonl`` (rank 0): one line per logged step. ``events.jsonl`` (every rank): start-up,
resume source, checkpoint commits, completion. The orchestrator tails both without importing
torch; lines are written whole and flushed, so a reader never sees half a record twice. A line
damaged anyway (a writer killed mid-line, a full disk) is skipped and counted by the reader.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from trainer.job.layout import EVENTS, METRICS  # noqa: F401 - the names the readers import


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


@dataclass
class NewLines:
    """What a read of a JSON-lines file found after its offset."""

    records: list[dict]  # the complete lines that are JSON objects, in order
    offset: int  # the byte offset after the last line consumed: the next read starts here
    damaged: int = 0  # complete lines skipped: not a JSON object (a torn write, disk-full zeros)


def _parse(line: bytes) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:  # not JSON, or not UTF-8
        return None
    return record if isinstance(record, dict) else None


def read_new_lines(path: str | Path, offset: int, final: bool = False) -> NewLines:
    """The records after byte ``offset``. A complete line (newline-terminated) that is not a JSON
    object is skipped and counted (a writer killed mid-line leaves a fragment that the next
    writer's line completes). A last line without its newline is left for the next read, since its
    writer may be writing it still; ``final`` (the writers are gone) takes it too, or counts it."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except (FileNotFoundError, NotADirectoryError):
        return NewLines([], offset)
    except IsADirectoryError:  # a hand-made mess where the stream belongs: nothing to read, one damage
        return NewLines([], offset, 1)
    end = len(chunk) if final else chunk.rfind(b"\n") + 1
    lines = [line for line in chunk[:end].split(b"\n") if line.strip()]
    records = [r for r in map(_parse, lines) if r is not None]
    return NewLines(records, offset + end, len(lines) - len(records))


def read_all(path: str | Path) -> list[dict]:
    """Every complete record of the file (damaged lines skipped)."""
    return read_new_lines(path, 0).records
