"""One run of a campaign at a time, chosen by where the campaign's state lives.

- State in the workdir (the default): the ``flock`` of ``pretrain.state.lock`` on
  ``<workdir>/campaign.lock``; the kernel drops it when its holder dies.
- State on shared storage (``checkpoint.state_uri``: an S3 prefix or a shared directory): a
  :class:`pretrain.state.lease.Lease` at ``<state_uri>/lease.json``, acquired with a conditional
  create, renewed by a keeper thread, expiring ``PRETRAIN_LEASE_TTL_S`` after its holder stopped
  renewing it (its process died, its machine went away). Its generation is the fencing token:
  jobs carry it (``JobConfig.lease``) and commit nothing once a newer run holds the lease; the
  ledger is written only while the lease is valid.

Either way the refusal is :class:`CampaignBusy` naming the holder and what to do, and the guard
is reentrant within a flow run, so the campaign's subflows share it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import MappingProxyType

from pretrain.settings import PretrainSettings
from pretrain.spec.campaign import CampaignSpec
from pretrain.state.lease import Lease, LeaseDamaged, LeaseHeld, LeaseKeeper, LeaseLost, current_generation
from pretrain.state.locations import client_options
from pretrain.state.lock import CampaignBusy, LockUnavailable, campaign_lock
from trainer.job.config import LeaseConfig
from trainer.storage import Storage, StorageError, open_storage

LEASE_KEY = "lease.json"


@dataclass
class HeldLease:
    """The lease this context holds for one state location, and its keeper."""

    lease: Lease
    keeper: LeaseKeeper
    lost: LeaseLost | None = None

    def check(self) -> None:
        """:class:`LeaseLost` unless this run surely still holds the lease (no storage read)."""
        if self.lost is not None:
            raise self.lost
        if not self.lease.valid():
            raise LeaseLost(
                f"the lease {self.lease.where} (generation {self.lease.generation}) was not renewed in "
                "time; another run may have taken the campaign over, so this run writes no more of its "
                "state. Run the campaign again once no other run of it is running"
            )


# The leases this context (a flow run and the subflows it calls) holds, by state location.
# Never changed in place: taking a lease sets a new mapping (the default is read-only).
_HELD: ContextVar[Mapping[str, HeldLease]] = ContextVar("pretrain_campaign_leases", default=MappingProxyType({}))


def state_location(spec: CampaignSpec) -> str | None:
    """The campaign's state location on shared storage; None: its workdir."""
    return spec.checkpoint.state_uri.rstrip("/") if spec.checkpoint.state_uri else None


def state_storage(spec: CampaignSpec) -> Storage:
    """The storage of ``checkpoint.state_uri`` (the checkpoints' endpoint and the blocks' credentials)."""
    return open_storage(state_location(spec), **client_options(spec))


def held(spec: CampaignSpec) -> HeldLease | None:
    """The lease this context holds on the campaign's state; None if none (or state is local)."""
    where = state_location(spec)
    return _HELD.get().get(where) if where else None


def job_lease(spec: CampaignSpec) -> LeaseConfig | None:
    """``JobConfig.lease`` for a job launched now: the state location, the lease key and the
    generation this run holds (read from storage when called outside the run's context); None
    for a campaign whose state is in its workdir."""
    where = state_location(spec)
    if where is None:
        return None
    mine = held(spec)
    generation = mine.lease.generation if mine else current_generation(state_storage(spec), LEASE_KEY)
    if generation is None:
        raise LeaseLost(
            f"no lease at {where}/{LEASE_KEY}: a job of campaign {spec.name!r} is launched only by the "
            "run that holds it. Run the campaign (`pretrain run`) rather than a stage on its own"
        )
    return LeaseConfig(location=where, key=LEASE_KEY, generation=generation)


def check_holds(spec: CampaignSpec) -> None:
    """:class:`LeaseLost` unless this run still holds the campaign's lease (one read of it): call
    it right before a write only the holder may make (e.g. the ``good`` pointer). Nothing to
    check for a campaign whose state is in its workdir, or outside the run's context."""
    mine = held(spec)
    if mine is not None:
        mine.check()
        mine.lease.check()


@contextmanager
def campaign_guard(
    spec: CampaignSpec, flow_run: str | None = None, settings: PretrainSettings | None = None
) -> Iterator[None]:
    """Hold the campaign for the block: :class:`CampaignBusy` at once if another run holds it,
    :class:`LockUnavailable` if its lock or lease cannot be used at all."""
    where = state_location(spec)
    if where is None:
        with campaign_lock(spec.workdir_path, spec.name, flow_run):
            yield
        return
    if where in _HELD.get():
        yield
        return
    settings = settings or PretrainSettings.from_env()
    who = f"{socket.gethostname()} pid {os.getpid()}" + (f", flow run {flow_run}" if flow_run else "")
    try:
        lease = Lease.acquire(
            state_storage(spec), LEASE_KEY, holder=who, ttl_s=settings.lease_ttl_s, margin_s=settings.lease_margin_s
        )
    except LeaseHeld as err:
        raise CampaignBusy(
            f"campaign {spec.name!r} (state in {where}) is already running: {err}; a run that died "
            "holds it until then. It resumes from the last checkpoint when run again"
        ) from None
    except (LeaseDamaged, StorageError) as err:
        raise LockUnavailable(f"cannot take the lease of campaign {spec.name!r} in {where}: {err}") from None
    mine = HeldLease(lease, keeper=None)  # type: ignore[arg-type] # (the keeper reports to it)
    mine.keeper = lease.keep(lambda lost: setattr(mine, "lost", lost))
    before = _HELD.get()
    _HELD.set({**before, where: mine})
    try:
        yield
    finally:
        _HELD.set(before)
        mine.keeper.stop()
        try:
            lease.release()
        except (StorageError, LeaseDamaged):
            pass  # it expires by itself
