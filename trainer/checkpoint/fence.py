"""Commit fencing: only the newest job of a stage commits checkpoints.

A saver orphaned by its agent (agent SIGKILLed, node lost) still persists a final snapshot on
its way out; by then the orchestrator may have started a newer job that commits its own
checkpoints to the same location. Each job's agents *claim* the location before training (a
small ``fence`` record naming the job, last writer wins), and a saver checks, immediately
before it persists and before it writes a manifest and the pointer, that the claim is still
its own; otherwise it writes nothing.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from trainer.job.config import LeaseConfig

FENCE = "fence"


def claim(store, job: str) -> None:
    """Make ``job`` (its job directory: unique per attempt) the one that commits to ``store``."""
    store.write_json(FENCE, {"job": job, "time": time.time()})


def holder(store) -> str | None:
    """The job that last claimed ``store``; None if none did (or the record is unreadable, which
    blocks nobody: the next job's claim rewrites it)."""
    try:
        record = store.read_json(FENCE)
    except (ValueError, UnicodeDecodeError):
        return None
    return record.get("job") if isinstance(record, dict) and isinstance(record.get("job"), str) else None


def superseded(store, job: str | None) -> str | None:
    """The newer job that owns ``store`` if it is not ``job`` (None: ``job`` may commit)."""
    if job is None:
        return None
    owner = holder(store)
    return owner if owner is not None and owner != job else None


# --- the campaign's lease: fencing by generation -------------------------------------------------
# Where campaign state lives on shared storage, one run of the campaign at a time holds a lease
# there (``pretrain.state.lease``); each holder gets the next *generation*. A job carries the
# generation it was launched under (``JobConfig.lease``) and commits only while the lease's
# record still has it: a job of a run that lost the lease cannot move ``latest`` or ``good``,
# however late its write arrives. The record's schema lives here because the trainer reads it
# and must not import ``pretrain``.

LEASE_FORMAT = "pretrain-lease/1"


class LeaseRecordDamaged(ValueError):
    """The lease object cannot be read as a lease; the message names it and what to do."""


@dataclass(frozen=True)
class LeaseRecord:
    """One version of the lease object, as stored (JSON)."""

    holder: str  # who holds it, for people: "host pid 123, flow run ..."
    generation: int  # fencing token: +1 at every change of holder
    token: str  # unique per write: tells a holder that a write it retried was its own
    expires_at: float  # holder's wall clock, seconds since the epoch
    ttl_s: float
    released: bool = False
    acquired_at: float = 0.0

    def to_bytes(self) -> bytes:
        body = {"format": LEASE_FORMAT, **self.__dict__}
        return (json.dumps(body, sort_keys=True) + "\n").encode()

    @classmethod
    def parse(cls, data: bytes, where: str) -> LeaseRecord:
        try:
            body = json.loads(data.decode())
            if not isinstance(body, dict) or body.get("format") != LEASE_FORMAT:
                raise ValueError(f"not a {LEASE_FORMAT} record")
            record = cls(
                holder=str(body["holder"]),
                generation=body["generation"],
                token=str(body["token"]),
                expires_at=float(body["expires_at"]),
                ttl_s=float(body["ttl_s"]),
                released=bool(body.get("released", False)),
                acquired_at=float(body.get("acquired_at", 0)),
            )
            if not isinstance(record.generation, int) or isinstance(record.generation, bool) or record.generation < 1:
                raise ValueError(f"generation {record.generation!r} is not a positive integer")
            return record
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise LeaseRecordDamaged(
                f"the lease {where} is damaged ({exc}); nobody can hold it until it is fixed. Make sure no run of "
                f"this campaign is still running (the lease keeps two from running at once), then delete {where} "
                "and run again"
            ) from None

    def describe(self) -> str:
        until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.expires_at))
        return f"{self.holder} (generation {self.generation}, expires {until} unless renewed)"


@dataclass(frozen=True)
class LeaseFence:
    """The lease a job runs under: where its record is and the generation the job was given."""

    location: str  # the campaign's state location (a directory or s3:// URL)
    key: str  # the lease object's key there
    generation: int  # the generation of the run that launched the job
    options: dict = field(default_factory=dict)  # storage options for ``location`` (no secrets)

    @classmethod
    def of_job(cls, lease: LeaseConfig | None, options: dict) -> LeaseFence | None:
        """The fence of a job's ``JobConfig.lease``; None when it has none (local state)."""
        return cls(lease.location, lease.key, lease.generation, dict(options)) if lease else None

    @property
    def where(self) -> str:
        return f"{self.location.rstrip('/')}/{self.key}"

    def fenced(self) -> str | None:
        """Why this job must never commit again (None: it may commit now): the lease's record
        carries a newer generation, so another run of the campaign took it over. A record that
        cannot be read raises (``StorageError``, ``LeaseRecordDamaged``): the caller holds its
        commit back, since nobody can then tell whether this job is still the campaign's."""
        from trainer.storage import open_storage

        now = LeaseRecord.parse(open_storage(self.location, **self.options).get_bytes(self.key), self.where)
        if now.generation != self.generation:
            return (
                f"fenced: the campaign's lease {self.where} is at generation {now.generation}, held by "
                f"{now.holder}, and this job runs under generation {self.generation}: another run of the "
                "campaign took it over, so this job commits nothing"
            )
        return None
