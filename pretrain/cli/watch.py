"""``pretrain status --watch``: follow a running campaign's training from another terminal, read
from its workdir only; ends when the campaign no longer runs (the caller then shows the table)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

from pretrain.cli.errors import err
from pretrain.console_progress import progress_display
from pretrain.views.follow import TITLE, CampaignFollower, show


def watch_campaign(workdir: Path, interval_s: float) -> None:
    """Draw the running stage's progress every ``interval_s`` until the campaign stops running.
    Ctrl-C ends the watch (exit 0), not the campaign. Raises ``NoCampaign`` / ``LedgerError``."""
    from pretrain.views.status import NoCampaign

    follower = CampaignFollower(workdir.expanduser().resolve())
    display = progress_display(TITLE, interval_s=interval_s, estimates=False)
    try:
        while True:
            snap = follower.look()
            if follower.record is None:
                raise NoCampaign(
                    f"no campaign in {workdir} (no ledger.json); start one with `pretrain run --workdir {workdir}`"
                )
            if snap is not None:
                for note in follower.watch.take_notes():  # the recoveries of the stage's job so far, then as they come
                    display.note(f"stage {snap.stage}: {note}")
            if snap is not None and snap.step >= 0:
                show(display, snap)
            if not follower.running():
                break
            time.sleep(interval_s)
    except KeyboardInterrupt:
        display.close()
        err.print("stopped watching; the campaign goes on", highlight=False)
        sys.stdout.flush()
        raise typer.Exit(0)
    display.close()
    err.print(f"campaign {follower.record.campaign} is not running ({follower.record.status.value})", highlight=False)
