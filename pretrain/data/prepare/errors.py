"""Why data preparation stopped, and the disk-full cleanup every data-set write goes through."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from trainer.common.diskfull import describe, is_disk_full


class DataPrepError(ValueError):
    """The data section of the spec cannot produce a data set; the message says why and what to do."""


@contextmanager
def removed_if_disk_full(out: Path, need: int, what: str = "the data set"):
    """Yields the list of files written inside; if the disk fills up, they are removed (a data
    set without its manifest is never used, and the space is needed to try again) and a
    :class:`DataPrepError` says so."""
    written: list[Path] = []
    try:
        yield written
    except OSError as err:
        if not is_disk_full(err):
            raise
        for path in written:
            path.unlink(missing_ok=True)
        raise DataPrepError(
            describe(
                out,
                need,
                what,
                "Free space there (or lower data.max_bytes) and run again; the half-written "
                "data set has no manifest and is never used.",
            )
        ) from None
