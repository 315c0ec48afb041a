"""How a campaign run ends before its pipeline does: an operator's stop, a pause, a cancel from Prefect.

A pause (``pretrain.run.budget``) comes from the run's time budget (``run_for`` / ``until``) or from
a signal: the running job is stopped with a save at breakpoint, the gate judges it, and the run
ends with the campaign *paused*. Under ``pretrain run`` its stop request (``pretrain.run.stop``)
carries Ctrl-C / SIGTERM; a flow run in its process's main thread (a deployment's run, a pod)
turns a SIGTERM into the same pause (``pause_on_termination``), and one cancelled from Prefect
still ends Cancelled. Past the pause's window, or at a second signal, everything stops at once
and the campaign is recorded *interrupted*.
"""

from __future__ import annotations

import contextvars
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.logging.handlers import APILogWorker
from prefect.runtime import flow_run

from pretrain.run.budget import PauseRequest, current_pause, deadline, pausing
from pretrain.run.outcome import record_interrupt, record_pause
from pretrain.run.stop import (
    CampaignInterrupted,
    StoppedAtOnce,
    StopRequest,
    current_stop,
    pause_on_termination,
    pause_window_s,
    supervise,
)
from pretrain.settings import PretrainSettings
from pretrain.spec.campaign import CampaignSpec
from pretrain.state.ledger import Ledger
from pretrain.state.schema import StageStatus
from pretrain.views.status import campaign_status
from tasks.artifacts import publish_reports

CANCELLED_FROM_PREFECT = "cancelled from Prefect"
ORIGIN_TIMEOUT_S = 5.0  # the API's answer to "is this run being cancelled?", asked once at the signal

Pipeline = Callable[[CampaignSpec, StopRequest | None], dict]


@contextmanager
def time_boxed(run_for: str | None, until: str | None) -> Iterator[PauseRequest]:
    """The run's pause request for the block: the one ``pretrain run`` (or a test) set, else this
    run's own, ending at the time budget's end, if any (a bad budget fails here, before anything)."""
    pause = current_pause() or PauseRequest()
    if end := deadline(run_for, until):
        pause.deadline, pause.started = end, time.time()
    with pausing(pause):
        yield pause


def stoppable(spec: CampaignSpec, pipeline: Pipeline) -> dict:
    """``pipeline(spec, stop)`` under the stop that applies: ``pretrain run``'s (Ctrl-C / SIGTERM);
    else, where this flow runs in its process's main thread (a deployment's run, a pod), a SIGTERM
    pauses it within the pause's window, and past it stops it at once."""
    stop = current_stop()  # set under `pretrain run`: Ctrl-C / SIGTERM stop the campaign
    if stop is not None:
        return _run_stoppable(spec, stop, pipeline)
    window_s = pause_window_s(spec.resume.grace_period_s, PretrainSettings.from_env().kill_grace_s)
    pause = current_pause()
    with pause_on_termination(lambda name: pause.ask(f"{name} received")) as stop:
        if stop is None:
            return pipeline(spec, None)
        # a cancelled run returns its status too: Prefect refuses the Completed of a run being
        # cancelled, and its worker or runner ends it Cancelled once this process exits
        try:
            return supervise(
                lambda: _run_stoppable(spec, stop, pipeline),
                stop,
                window_s,
                get_run_logger().warning,
                "resume.grace_period_s or PRETRAIN_KILL_GRACE_S less 5s",
                "a second SIGTERM",
                on_request=lambda: _note_origin(stop),
            )
        except StoppedAtOnce:
            if stop.origin == CANCELLED_FROM_PREFECT:
                _leave_to_the_worker()
            raise  # any other SIGTERM goes on to Prefect's handler: the run ends Crashed, as before


def _run_stoppable(spec: CampaignSpec, stop: StopRequest, pipeline: Pipeline) -> dict:
    stop.flow_run = flow_run.get_id()
    here = contextvars.copy_context()
    stop.recorder = lambda cause, warn: here.run(record_interrupt, spec, stop, stop.describe(cause), warn)
    try:
        return pipeline(spec, stop)
    except Exception as e:
        if not stop.requested.is_set():
            raise
        raise record_interrupted(spec, stop, e) from None


def being_cancelled() -> bool:
    """Whether this flow run is being cancelled: Prefect's worker or runner marks it Cancelling,
    then sends its SIGTERM. False for any other SIGTERM (a pod eviction, a worker shutting down,
    ``kill``), and when the API does not answer within seconds (the signal's name says enough)."""
    try:
        with get_client(sync_client=True, httpx_settings={"timeout": ORIGIN_TIMEOUT_S}) as client:
            state = client.read_flow_run(flow_run.get_id()).state
    except Exception:  # noqa: BLE001 - a cause less precise, never a failure
        return False
    return state is not None and (state.is_cancelling() or state.is_cancelled())


def _leave_to_the_worker() -> None:
    """End this process as SIGTERM's default action does, once the stop at once is recorded:
    the worker that is cancelling the run then ends it Cancelled (handed to Prefect's handler, a
    SIGTERM whose cancel the worker could not deliver ends the run Crashed first)."""
    APILogWorker.drain_all(timeout=2)  # the run's last lines (the stop at once) reach its logs
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _note_origin(stop: StopRequest) -> None:
    if being_cancelled():
        stop.origin = CANCELLED_FROM_PREFECT


def record_interrupted(spec: CampaignSpec, stop: StopRequest, error: Exception) -> CampaignInterrupted:
    """Record the campaign as interrupted (ledger, MLflow); whatever broke on the way out (a
    validation process the terminal's Ctrl-C also reached), the cause is the operator's stop."""
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    interrupted = (
        error
        if isinstance(error, CampaignInterrupted)
        else CampaignInterrupted(f"campaign interrupted by {stop.name} ({first_line})", stop.signum)
    )
    logger = get_run_logger()
    record_interrupt(spec, stop, str(interrupted), logger.warning)
    logger.warning("%s; run the same command again to resume", interrupted)
    return interrupted


class StopPoints:
    """The pipeline's points between steps where its run may end early: ``check`` raises at an
    operator's stop; ``pause_due`` says why the campaign pauses now."""

    def __init__(self, stop: StopRequest | None):
        self.stop, self.pause = stop, current_pause()

    def check(self, where: str) -> None:
        if self.stop is not None and self.pause is None:  # with a pause request, a signal pauses (pause_due)
            self.stop.raise_if_requested(where)

    def pause_due(self) -> str | None:
        """A spent budget, or a signal to `pretrain run` (None: go on)."""
        return self.pause.due() if self.pause is not None else None


def next_stage(spec: CampaignSpec, ledger: Ledger) -> tuple[str, int]:
    """The first stage not completed, and its newest good step (0: none)."""
    stages = ledger.reload().stages
    name = next((s.name for s in spec.stages if stages[s.name].status != StageStatus.COMPLETED), spec.stages[-1].name)
    return name, max(stages[name].newest_good_step(), 0)


def paused(spec: CampaignSpec, stage: str, step: int, reason: str) -> dict:
    """End this run with the campaign paused (ledger, MLflow runs scheduled); its status."""
    stop = current_stop()
    if stop is not None and stop.signum is not None and reason == f"{stop.name} received":
        reason = stop.describe(reason)  # a signal's pause: "cancelled from Prefect (SIGTERM from its worker)"
    record = record_pause(spec, flow_run.get_id(), stage, step, reason)
    get_run_logger().info("campaign %s %s; run it again to continue", spec.name, record.end.cause)
    status = campaign_status(spec.workdir_path, spec.credentials.s3_options())
    publish_reports(spec, status)
    return status
