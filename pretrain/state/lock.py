"""One campaign run at a time per workdir: an exclusive ``flock`` on ``<workdir>/campaign.lock``,
held by the process that runs the campaign flow for as long as it runs.

The kernel drops the lock when that process ends, however it ends (a crash, SIGKILL, a
cancelled flow run), so a stale lock never blocks the next run. The file names the holder
(host, pid, flow run, start time) so the refused run can say who has it. Every flow that writes
campaign state takes it; within one flow run it is reentrant, so the campaign's subflows share it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from types import MappingProxyType

LOCK_NAME = "campaign.lock"


class CampaignBusy(RuntimeError):
    """Another run of the same campaign holds its workdir."""


def _describe(holder: dict) -> str:
    if not holder:
        return "another process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    run = f", flow run {holder['flow_run']}" if holder.get("flow_run") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{run}, since {since}"


def read_holder(workdir: str | Path) -> dict:
    """What the lock file says about its (last) holder; empty if unknown."""
    try:
        return json.loads((Path(workdir) / LOCK_NAME).read_text() or "{}")
    except (OSError, ValueError):
        return {}


# The lock files this context (a flow run and the subflows it calls) holds, with their holder:
# a subflow that writes campaign state (prepare-data) takes the lock its campaign already holds.
# Never changed in place: taking a lock sets a new mapping (the default is read-only).
_HELD: ContextVar[Mapping[str, dict]] = ContextVar("pretrain_campaign_locks", default=MappingProxyType({}))

# errno of a filesystem that cannot lock files, and what to do about it
_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOLCK, errno.ENOSYS, errno.EINVAL}


class LockUnavailable(RuntimeError):
    """The campaign's lock file cannot be created or locked (not: someone else holds it)."""


def lock_failure(path: Path, err: OSError) -> LockUnavailable:
    """The error for a lock file that cannot be locked: names the file and what to do."""
    why = f"{err.strerror or err} (errno {errno.errorcode.get(err.errno, err.errno)})"
    if err.errno in _UNSUPPORTED:
        return LockUnavailable(
            f"cannot lock {path}: its filesystem does not support file locks: {why}. The lock keeps two runs of "
            "one campaign from training at once. Put the campaign's workdir on a local filesystem (`workdir` in the "
            "spec, or --workdir), or, where one machine runs the campaign, mount the NFS share with -o local_lock=flock"
        )
    return LockUnavailable(
        f"cannot lock {path}: {why}. Check that the campaign's workdir is writable, or choose "
        "another one (`workdir` in the spec, or --workdir)"
    )


def lock_fd(fd: int, path: Path) -> None:
    """``flock`` the open lock file: BlockingIOError if another holder has it, :class:`LockUnavailable`
    if its filesystem cannot lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise
    except OSError as err:
        raise lock_failure(path, err) from None


@contextmanager
def campaign_lock(workdir: str | Path, campaign: str, flow_run: str | None = None) -> Iterator[dict]:
    """Hold the campaign's workdir for the duration of the block; raises :class:`CampaignBusy` at
    once if another run holds it (no waiting: a second training run must not queue silently).
    Reentrant within one flow run: a subflow the campaign calls shares the campaign's lock."""
    path = Path(workdir) / LOCK_NAME
    key = str(path.resolve())
    if key in _HELD.get():
        yield _HELD.get()[key]
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise lock_failure(path, err) from None
    try:
        try:
            lock_fd(fd, path)
        except BlockingIOError:
            raise CampaignBusy(
                f"campaign {campaign!r} in {Path(workdir)} is already running ({_describe(read_holder(workdir))}). "
                "Two runs of one campaign must not train at once: wait for that run to finish, or cancel it, "
                "then run again (it resumes from the last checkpoint)"
            ) from None
        holder = {
            "campaign": campaign,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "flow_run": flow_run,
            "since": time.time(),
        }
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
        except OSError as err:
            raise lock_failure(path, err) from None
        held = _HELD.get()
        _HELD.set({**held, key: holder})
        try:
            yield holder
        finally:
            _HELD.set(held)
    finally:
        os.close(fd)  # releases the lock


@contextmanager
def updating(path: Path, timeout_s: float = 60.0) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``<path>.lock`` for a read-modify-write of ``path``: two
    writers (the flow thread and the CLI's stop at once in one process: a ``flock`` taken through
    two opens excludes threads too; or two processes) never interleave, so neither update is lost.
    A filesystem that cannot lock files proceeds unlocked (the campaign lock, which refuses such a
    workdir, is what keeps two runs apart)."""
    lock = path.with_name(path.name + ".lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield  # an unwritable directory: the write itself reports it
        return
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise CampaignBusy(
                        f"{path} has been locked for an update for {timeout_s:.0f}s by another "
                        f"writer ({lock}); if no other run of this campaign is alive, remove {lock}"
                    ) from None
                time.sleep(0.01)  # poll: writers hold it for one small file write
            except OSError:
                break  # no locks on this filesystem
        yield
    finally:
        os.close(fd)
