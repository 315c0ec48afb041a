"""The ledger on shared storage (``checkpoint.state_uri``): one JSON object changed only with
conditional writes, so two writers never lose each other's updates.

Every change is a typed mutation of the record (``Ledger.mutate``): read the object and its
version (ETag), apply the mutation, write it back only if the object is still that version
(``put_if_match``; ``put_if_absent`` for the first write). A writer that loses the race reads
again and re-applies its mutation to what the other wrote. After ``tries`` lost races in a row
the write is refused with an error that says why; nothing is overwritten blindly.

Objects on S3 do not tear (a PUT is all or nothing), so unlike the local file there is no
``.prev`` generation: a damaged object is a foreign write, reported naming it and what to do.

Each write counts up the record's ``revision``. The workdir of the run keeps a read-only copy
(:func:`keep_copy`, ``copy_of`` naming the object) that readers of a workdir read; a slower
thread's older revision never replaces a newer copy.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from pretrain.state.local import LedgerError, _read
from pretrain.state.lock import updating
from pretrain.state.schema import CampaignRecord
from trainer.common.atomic import atomic_write_json
from trainer.storage import NotFound, PreconditionFailed, Storage

LEDGER_KEY = "ledger.json"


class LedgerConflict(RuntimeError):
    """Every try of a ledger write lost the race to another writer."""


@dataclass
class RemoteLedger:
    """The ledger object ``key`` in ``storage``."""

    storage: Storage
    parse: Callable[[str, bytes], CampaignRecord]  # bytes → record, LedgerDamaged naming the object
    key: str = LEDGER_KEY
    tries: int = 20  # lost races in a row before a write is refused
    guard: Callable[[], None] | None = None  # called before each write: raises if this run may no longer write

    @property
    def where(self) -> str:
        return f"{self.storage.url.rstrip('/')}/{self.key}"

    def _get(self) -> tuple[str, CampaignRecord] | None:
        try:
            data, etag = self.storage.get_versioned(self.key)
        except NotFound:
            return None
        return etag, self.parse(self.where, data)

    def load(self) -> CampaignRecord | None:
        """The stored record; None if there is none."""
        read = self._get()
        return None if read is None else read[1]

    def update(self, change: Callable[[CampaignRecord], object], fresh: CampaignRecord) -> CampaignRecord:
        """Apply ``change`` to the stored record (to a copy of ``fresh`` if there is none yet) and
        write it back if nobody wrote in between; else again, on what they wrote."""
        for attempt in range(self.tries):
            read = self._get()
            record = read[1] if read is not None else fresh.model_copy(deep=True)
            change(record)
            record.revision, record.copy_of = (read[1].revision if read is not None else fresh.revision) + 1, None
            body = json.dumps(record.to_json(), indent=2).encode()
            if self.guard is not None:
                self.guard()
            try:
                if read is None:
                    self.storage.put_if_absent(self.key, body)
                else:
                    self.storage.put_if_match(self.key, body, read[0])
                return record
            except PreconditionFailed:
                time.sleep(random.uniform(0, min(1.0, 0.02 * 2**attempt)))  # backoff: let the other writer finish
        raise LedgerConflict(
            f"the ledger {self.where} changed under each of {self.tries} tries to write it: other processes keep "
            "writing it. Only the run that holds the campaign's lease writes its ledger: check that no other "
            "run of this campaign (or a tool writing its state) is running, then run again"
        )


def keep_copy(path: Path, record: CampaignRecord, where: str) -> None:
    """Write ``record`` of the ledger object ``where`` as the workdir's read-only copy at ``path``,
    unless the copy there is of a newer revision. The copy is a convenience for readers: a workdir
    that is gone or cannot be written is logged, never raised (the object is the ledger)."""
    if not path.parent.is_dir():
        return
    copy = record.model_copy(update={"copy_of": where})
    try:
        with updating(path):
            with suppress(LedgerError):  # a damaged copy is replaced
                held = _read(path)
                if held is not None and held.copy_of == where and held.revision > record.revision:
                    return
            atomic_write_json(path, copy.to_json(), sort_keys=False)
    except OSError as err:
        logging.getLogger(__name__).warning(
            "could not update %s, the workdir's copy of the campaign's ledger %s (%s): "
            "`pretrain status` there may show an older state",
            path,
            where,
            err,
        )


def refuse_foreign_workdir(path: Path, where: str) -> None:
    """:class:`LedgerError` if the workdir's ledger file ``path`` is not a copy of ``where``: a
    campaign kept in that workdir, or the copy of another campaign's ledger, is never overwritten."""
    try:
        held = _read(path)
    except LedgerError as err:
        raise LedgerError(f"{err}. (This campaign's ledger is {where}; its workdir only keeps a copy of it.)") from None
    if held is None or held.copy_of == where:
        return
    whose = (
        f"keeps a copy of the ledger {held.copy_of}"
        if held.copy_of
        else f"holds the ledger of campaign {held.campaign!r}, kept in that workdir"
    )
    raise LedgerError(
        f"{path.parent} {whose}; this campaign's ledger is {where}: give this campaign a workdir of "
        "its own (--workdir pointing to an empty directory)"
    )
