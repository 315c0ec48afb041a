"""One campaign run at a time per workdir: an exclusive ``flock`` on ``<workdir>/campaign.lock``,
held by the process that runs the campaign flow for as long as it runs.

The kernel drops the lock when that process ends, however it ends (a crash, SIGKILL, a
cancelled flow run), so a stale lock never blocks the next run. The file names the holder
(host, pid, flow run, start time) so the refused run can say who has it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

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


@contextmanager
def campaign_lock(workdir: str | Path, campaign: str, flow_run: str | None = None) -> Iterator[dict]:
    """Hold the campaign's workdir for the duration of the block; raises :class:`CampaignBusy` at
    once if another run holds it (no waiting: a second training run must not queue silently)."""
    path = Path(workdir) / LOCK_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CampaignBusy(
                f"campaign {campaign!r} in {Path(workdir)} is already running ({_describe(read_holder(workdir))}). "
                "Two runs of one campaign must not train at once: wait for that run to finish, or cancel it, "
                "then run again (it resumes from the last checkpoint)") from None
        holder = {"campaign": campaign, "host": socket.gethostname(), "pid": os.getpid(), "flow_run": flow_run,
                  "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        yield holder
    finally:
        os.close(fd)  # releases the lock
