"""How ``pretrain run`` runs the campaign flow in its own process, so that Ctrl-C and SIGTERM stop it.

The flow runs in a thread; the main thread only waits and owns the signals (Prefect installs its
own SIGTERM handler only when a flow runs in the main thread). The first signal asks the
campaign to pause (``pretrain.budget``), as a spent time budget does: the training task stops
its job with a save at breakpoint, the gate judges it, and the flow records the campaign
paused. A second signal — or the spec's ``resume.grace_period_s`` running out first — kills the
job at once, records the campaign interrupted from here, and returns without waiting for the
flow thread.
The Prefect API server the flow talks to is this process's own (``deployments.api_server``),
out of the terminal's reach, and stopped last.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from deployments.api_server import api_server_for_this_run
from pretrain.budget import PauseRequest, current_pause, pausing
from pretrain.interrupt import CampaignInterrupted, CampaignPaused, StoppedAtOnce, StopRequest, stop_on_signals
from pretrain.spec import CampaignSpec

WAIT_S = 0.2  # how often the main thread looks at the stop request while the flow runs


class _NoInterruptTraceback(logging.Formatter):
    """An operator's stop is not an error: Prefect logs the exception of every task and flow it
    ends with its traceback. On the console, once a stop is asked for, show only the message
    (the interruption itself, or what the terminal's Ctrl-C broke on the way, e.g. a validation
    process in its process group); Prefect's API logs keep the tracebacks."""

    def __init__(self, inner: logging.Formatter | None, stop: StopRequest):
        super().__init__()
        self.inner, self.stop = inner or logging.Formatter(), stop

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info and (self.stop.requested.is_set() or isinstance(record.exc_info[1], CampaignInterrupted)):
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        return self.inner.format(record)


@contextmanager
def _quiet_interrupt_tracebacks(stop: StopRequest) -> Iterator[None]:
    from prefect.logging.handlers import PrefectConsoleHandler

    handlers = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    formatters = [h.formatter for h in handlers]
    for h in handlers:
        h.setFormatter(_NoInterruptTraceback(h.formatter, stop))
    try:
        yield
    except StoppedAtOnce:
        raise  # kept: the flow thread goes on logging until the process exits
    except BaseException:
        _set_formatters(handlers, formatters)
        raise
    _set_formatters(handlers, formatters)


def _set_formatters(handlers: list[logging.Handler], formatters: list[logging.Formatter | None]) -> None:
    for h, f in zip(handlers, formatters):
        h.setFormatter(f)


def _stop_at_once(stop: StopRequest, notice: Callable[[str], None], why: str = "by a second signal") -> StoppedAtOnce:
    """Kill the running job and record the campaign as interrupted (unless the flow already has)."""
    stop.kill_now()
    cause = f"campaign interrupted by {stop.name}, then stopped at once {why}"
    if stop.recorder is not None:  # None: the campaign never started
        stop.recorder(cause, notice)
    return StoppedAtOnce(cause, stop.signum)


def run_campaign_here(spec: CampaignSpec, notice: Callable[[str], None]) -> dict:
    """Run (or resume) the campaign in this process and return its status. Raises
    ``CampaignPaused`` when a signal paused it cleanly, ``CampaignInterrupted`` (``StoppedAtOnce``
    after a second signal or the grace period) when it stopped otherwise, whatever the flow raised
    on the way out; other errors as the flow raised them."""
    from flows.campaign import pretrain_campaign
    from pretrain.outcome import pause_cause

    pause = current_pause() or PauseRequest()  # `pretrain run --for` sets one with its deadline
    grace_s = spec.resume.grace_period_s
    with stop_on_signals() as stop, pausing(pause), api_server_for_this_run(), _quiet_interrupt_tracebacks(stop):
        stop.raise_if_requested("before the campaign started")
        stop.on_first = lambda name: pause.ask(f"{name} received")
        outcome: dict = {}
        context = contextvars.copy_context()  # the stop and pause requests, the API server's settings

        def target() -> None:
            try:
                outcome["status"] = context.run(pretrain_campaign, spec=spec)
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                outcome["error"] = e

        flow = threading.Thread(target=target, name="campaign-flow", daemon=True)
        flow.start()
        asked_at = None
        while flow.is_alive():
            flow.join(WAIT_S)
            if stop.urgent.is_set():
                notice(f"{stop.name} again: stopping at once")
                raise _stop_at_once(stop, notice)
            if stop.requested.is_set() and asked_at is None:
                asked_at = time.monotonic()
                notice(f"{stop.name} received: pausing the campaign; the running job is stopping with a final "
                       f"checkpoint, which is validated (up to {grace_s:.0f}s: resume.grace_period_s; Ctrl-C or the "
                       "same signal again stops at once)")
            if asked_at is not None and time.monotonic() - asked_at > grace_s:
                notice(f"the campaign did not pause within resume.grace_period_s ({grace_s:.0f}s): stopping at once")
                raise _stop_at_once(stop, notice, f"when resume.grace_period_s ({grace_s:.0f}s) ran out")
        error = outcome.get("error")
        if error is None:
            status = outcome["status"]
            if stop.requested.is_set() and status.get("status") == "paused":
                raise CampaignPaused(f"campaign {pause_cause(spec.workdir_path)}", stop.signum)
            return status
        if stop.requested.is_set():  # whatever broke on the way out, the cause is the stop
            if isinstance(error, CampaignInterrupted):
                error.signum = stop.signum
                raise error
            raise CampaignInterrupted(f"campaign interrupted by {stop.name} ({error})", stop.signum) from error
        raise error
