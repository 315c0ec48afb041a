"""How ``pretrain run`` runs the campaign flow in its own process, so that Ctrl-C and SIGTERM stop it.

The flow runs in a thread; the main thread only waits and owns the signals (Prefect installs its
own SIGTERM handler only when a flow runs in the main thread). The first signal asks the
campaign to pause (``pretrain.run.budget``), as a spent time budget does: the training task stops
its job with a save at breakpoint, the gate judges it, and the flow records the campaign
paused. A second signal — or the spec's ``resume.grace_period_s`` running out first — kills the
job at once, records the campaign interrupted from here, and returns without waiting for the
flow thread.
The Prefect API server the flow talks to is this process's own (``deployments.api_server``),
out of the terminal's reach, and stopped last.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from deployments.api_server import api_server_for_this_run
from deployments.console import quiet_console
from pretrain.run.budget import PauseRequest, current_pause, pausing
from pretrain.run.stop import CampaignInterrupted, CampaignPaused, StoppedAtOnce, stop_on_signals, supervise
from pretrain.spec.campaign import CampaignSpec


def run_campaign_here(spec: CampaignSpec, notice: Callable[[str], None]) -> dict:
    """Run (or resume) the campaign in this process and return its status. Raises
    ``CampaignPaused`` when a signal paused it cleanly, ``CampaignInterrupted`` (``StoppedAtOnce``
    after a second signal or the grace period) when it stopped otherwise, whatever the flow raised
    on the way out; other errors as the flow raised them."""
    from pretrain.run.outcome import pause_cause

    pause = current_pause() or PauseRequest()  # `pretrain run --for` sets one with its deadline
    grace_s = spec.resume.grace_period_s
    with (
        stop_on_signals() as stop,
        pausing(pause),
        api_server_for_this_run(while_starting=lambda: importlib.import_module("flows.campaign"), notice=notice),
        quiet_console(),
    ):
        from flows.campaign import pretrain_campaign

        stop.raise_if_requested("before the campaign started")
        stop.on_first = lambda name: pause.ask(f"{name} received")
        try:
            status = supervise(lambda: pretrain_campaign(spec=spec), stop, grace_s, notice)
        except StoppedAtOnce:
            raise
        except BaseException as error:  # noqa: BLE001 - whatever broke on the way out, the cause is the stop
            if not stop.requested.is_set():
                raise
            if isinstance(error, CampaignInterrupted):
                error.signum = stop.signum
                raise
            raise CampaignInterrupted(f"campaign interrupted by {stop.name} ({error})", stop.signum) from error
        if stop.requested.is_set() and status.get("status") == "paused":
            raise CampaignPaused(f"campaign {pause_cause(spec.workdir_path)}", stop.signum)
        return status
