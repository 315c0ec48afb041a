"""A lease in campaign storage: at most one holder at a time, for as long as it keeps renewing.

Where campaign state lives on shared storage (an S3 prefix, a shared volume), a local ``flock``
cannot keep two orchestrators apart; a lease record in that storage can. It is one small JSON
object written only with conditional writes (``Storage.put_if_absent`` / ``put_if_match``), so
of two contenders exactly one wins and the other is told who holds it:

- acquire: create the record if there is none; or replace it, conditionally on the version just
  read, when its holder released it or its expiry has passed;
- renew: rewrite it with a later expiry, conditionally on the version this holder last wrote; a
  renewal that loses the race means someone took the lease over: :class:`LeaseLost`;
- release: rewrite it as released (never deleted, so its generation survives).

``generation`` is the fencing token: it grows by one at every change of holder (takeover after
expiry or release) and never goes back while the record exists. Work done under the lease
carries it (e.g. in every checkpoint commit), and a check against the record's current
generation refuses a holder that lost the lease, however late its write arrives.

Clock skew: a holder writes its expiry on its own wall clock; a contender takes over only when
its own clock is past that expiry plus ``margin_s``. A holder considers its lease valid only
until ``ttl_s`` after it started its last successful write, on its monotonic clock. So as long as
the two clocks differ by less than ``margin_s``, a holder always knows it has lost the lease
before anyone else can take it. Fencing by generation stays safe whatever the clocks do.

No Prefect here: the orchestrator and the pods can both use it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from trainer.checkpoint.fence import LEASE_FORMAT, LeaseRecord, LeaseRecordDamaged
from trainer.storage import NotFound, PreconditionFailed, Storage, StorageError

FORMAT = LEASE_FORMAT


class LeaseError(RuntimeError):
    """A lease could not be acquired, kept or read; the message says why and what to do."""


class LeaseHeld(LeaseError):
    """Another holder has the lease and it has not expired."""


class LeaseLost(LeaseError):
    """This holder no longer has the lease (taken over after expiry, or not renewed in time)."""


class LeaseDamaged(LeaseError):
    """The lease record cannot be read as a lease: nobody may take it until a person looks."""


def default_holder() -> str:
    """Who is asking, for messages: host and pid."""
    return f"{socket.gethostname()} pid {os.getpid()}"


def _parse(data: bytes, where: str) -> LeaseRecord:
    """The record's schema lives in the trainer (its jobs read it to fence their commits)."""
    try:
        return LeaseRecord.parse(data, where)
    except LeaseRecordDamaged as exc:
        raise LeaseDamaged(str(exc)) from None


@dataclass
class Lease:
    """A lease this process holds; get one with :meth:`acquire`."""

    storage: Storage
    key: str
    record: LeaseRecord
    etag: str
    margin_s: float
    clock: Callable[[], float] = time.time
    deadline: float = 0.0  # monotonic: the lease is surely ours until then
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def generation(self) -> int:
        return self.record.generation

    @property
    def where(self) -> str:
        return f"{self.storage.url}/{self.key}"

    def valid(self) -> bool:
        """True while the last successful write guarantees nobody else can hold the lease."""
        return not self.record.released and time.monotonic() < self.deadline

    @classmethod
    def acquire(
        cls,
        storage: Storage,
        key: str,
        holder: str | None = None,
        ttl_s: float = 60.0,
        margin_s: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> Lease:
        """Take the lease at ``key`` for ``holder``; :class:`LeaseHeld` if someone else has it,
        :class:`LeaseDamaged` if its record is unreadable, ``StorageError`` if storage fails."""
        if ttl_s <= 0 or margin_s < 0:
            raise ValueError(f"ttl_s must be > 0 and margin_s >= 0 (got {ttl_s}, {margin_s})")
        holder = holder or default_holder()
        where = f"{storage.url}/{key}"
        now, started = clock(), time.monotonic()
        try:
            data, etag = storage.get_versioned(key)
        except NotFound:
            current, etag = None, None
        else:
            current = _parse(data, where)
            if not current.released and now <= current.expires_at + margin_s:
                raise LeaseHeld(_held_message(where, current))
        mine = LeaseRecord(
            holder=holder,
            generation=current.generation + 1 if current else 1,
            token=uuid.uuid4().hex,
            expires_at=now + ttl_s,
            ttl_s=ttl_s,
            acquired_at=now,
        )
        try:
            etag = (
                storage.put_if_match(key, mine.to_bytes(), etag)
                if current
                else storage.put_if_absent(key, mine.to_bytes())
            )
        except PreconditionFailed:
            winner, etag = _read(storage, key, where)
            if winner is None or winner.token != mine.token:  # (equal: our own retried write won)
                raise LeaseHeld(
                    _held_message(where, winner)
                    if winner
                    else f"the lease {where} changed while {holder} tried to take it; run again"
                ) from None
        return cls(storage, key, mine, etag, margin_s, clock, started + ttl_s)

    def renew(self) -> None:
        """Push the expiry ``ttl_s`` ahead; :class:`LeaseLost` if someone took the lease over."""
        with self._lock:
            if self.record.released:
                raise LeaseLost(f"the lease {self.where} was released by this holder; acquire it again")
            now, started = self.clock(), time.monotonic()
            new = replace(self.record, token=uuid.uuid4().hex, expires_at=now + self.record.ttl_s)
            self.etag = self._replace(new)
            self.record, self.deadline = new, started + new.ttl_s

    def release(self) -> bool:
        """Give the lease up now (its generation stays); False if it had already been lost."""
        with self._lock:
            if self.record.released:
                return True
            gone = replace(self.record, token=uuid.uuid4().hex, expires_at=self.clock(), released=True)
            try:
                self.etag = self._replace(gone)
            except LeaseLost:
                return False
            finally:
                self.deadline = 0.0
            self.record = gone
            return True

    def check(self) -> None:
        """:class:`LeaseLost` unless the stored lease is still this holder's generation: call it
        right before a write that only the holder may make (it reads the storage, one GET)."""
        now, _ = _read(self.storage, self.key, self.where)
        if now is None or now.generation != self.generation or now.released:
            raise self._lost(now, "must not write campaign state any more")

    def _replace(self, new: LeaseRecord) -> str:
        """Write ``new`` if the record is still the version this holder wrote last."""
        try:
            return self.storage.put_if_match(self.key, new.to_bytes(), self.etag)
        except PreconditionFailed:
            now, etag = _read(self.storage, self.key, self.where)
            if now is not None and now.token == new.token:  # a retried write of ours had landed
                return etag
            raise self._lost(now, "must stop: another run took over after the lease expired") from None

    def _lost(self, now: LeaseRecord | None, consequence: str) -> LeaseLost:
        """The error for a holder whose lease is now ``now`` (a newer generation, released, gone)."""
        who = (
            f"it is now {'released by' if now.released else 'held by'} {now.describe()}"
            if now
            else "its record was deleted"
        )
        return LeaseLost(
            f"lost the lease {self.where} (generation {self.generation}): {who}. This holder {consequence}"
        )

    def keep(self, on_lost: Callable[[LeaseLost], None], interval_s: float | None = None) -> LeaseKeeper:
        """A started background thread that renews every ``interval_s`` (default ``ttl_s / 3``)
        and calls ``on_lost`` once if the lease is lost; use as a context manager."""
        return LeaseKeeper(self, on_lost, interval_s or self.record.ttl_s / 3).start()


def _read(storage: Storage, key: str, where: str) -> tuple[LeaseRecord | None, str | None]:
    try:
        data, etag = storage.get_versioned(key)
    except NotFound:
        return None, None
    return _parse(data, where), etag


def _held_message(where: str, record: LeaseRecord) -> str:
    return (
        f"the lease {where} is held by {record.describe()}. Only one run of a campaign may run at a "
        "time: wait for that run to finish or cancel it; if it died, the lease expires by itself"
    )


def current_generation(storage: Storage, key: str) -> int | None:
    """The generation of the lease at ``key`` now (None if there is none): a holder whose
    generation differs lost the lease and must not commit."""
    record, _ = _read(storage, key, f"{storage.url}/{key}")
    return record.generation if record else None


class LeaseKeeper:
    """Renews a lease in a background thread until stopped; on loss calls ``on_lost`` once.

    A storage error is retried (every ``interval_s / 4``) until the lease's own deadline: storage
    that stays away longer than that means the lease may have expired, which counts as lost.
    """

    def __init__(self, lease: Lease, on_lost: Callable[[LeaseLost], None], interval_s: float):
        self.lease, self.on_lost, self.interval_s = lease, on_lost, interval_s
        self.lost: LeaseLost | None = None
        self.renewals = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-keeper {lease.key}", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> LeaseKeeper:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        wait = self.interval_s
        while not self._stop.wait(wait):
            try:
                self.lease.renew()
                self.renewals, wait = self.renewals + 1, self.interval_s
                continue
            except LeaseLost as exc:
                self.lost = exc
            except (StorageError, LeaseDamaged) as exc:
                if time.monotonic() < self.lease.deadline:
                    wait = self.interval_s / 4
                    continue
                self.lost = LeaseLost(
                    f"could not renew the lease {self.lease.where} before it expired ({exc}); "
                    "this holder must stop, another run may take over"
                )
            self.on_lost(self.lost)
            return
