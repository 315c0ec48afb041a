"""SIGTERM to a flow-run process (Prefect's cancellation, a pod eviction) pauses the campaign:
real signals to this process, whose main thread plays the flow-run process's. The campaign
itself, cancelled through a real worker, is in test_prefect_server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run
from prefect.states import Cancelling, Running

from flows.stopping import being_cancelled
from pretrain.run.stop import StopRequest, current_stop, pause_on_termination, pause_window_s, supervise
from support.campaigns import wait_for

ROOT = Path(__file__).resolve().parents[2]


class HandedOn(BaseException):
    """What the handler installed before (Prefect's raises TerminationSignal) did."""


def previous_handler(signum, _frame):
    raise HandedOn(signum)


@pytest.fixture
def prefect_like_handler():
    """SIGTERM handled as in a flow-run process: Prefect's handler raises in the main thread."""
    before = signal.signal(signal.SIGTERM, previous_handler)
    yield
    signal.signal(signal.SIGTERM, before)


@pytest.fixture
def campaign():
    """What the campaign thread does, and a way to let it end."""
    release = threading.Event()
    yield release
    release.set()


@pytest.mark.parametrize(
    "grace_period_s, kill_grace_s, window_s",
    [
        (300, 30, 25),  # Prefect's worker and runner: SIGKILL 30 s after SIGTERM; 5 s kept to stop at once
        (10, 30, 10),  # the spec's own grace period is shorter
        (300, 600, 300),  # a pod with a long terminationGracePeriodSeconds
        (300, 4, 1),  # a kill grace shorter than the stop at once: still a try
    ],
)
def test_the_pause_window_fits_before_the_infrastructures_sigkill(grace_period_s, kill_grace_s, window_s):
    assert pause_window_s(grace_period_s, kill_grace_s) == window_s


def test_sigterm_pauses_and_the_campaign_returns_its_status(prefect_like_handler, campaign):
    asked, notices, killed = [], [], []
    with pause_on_termination(asked.append) as stop:
        assert current_stop() is stop

        def body():
            forget = stop.kill_at_once(lambda: killed.append("job"))
            os.kill(os.getpid(), signal.SIGTERM)  # the worker's SIGTERM, handled in the main thread
            wait_for(lambda: len(asked) == 2, 10, "the pause to be asked, and the signal's origin looked up")
            forget()
            return {"status": "paused"}

        assert supervise(body, stop, 60, notices.append, on_request=lambda: asked.append("origin looked up")) == {
            "status": "paused"
        }
    assert asked == ["SIGTERM", "origin looked up"] and killed == []
    assert notices[0].startswith("SIGTERM received: pausing the campaign")
    assert signal.getsignal(signal.SIGTERM) is previous_handler and current_stop() is None


def test_a_second_sigterm_stops_at_once_and_hands_the_signal_on(prefect_like_handler, campaign):
    killed, recorded = [], []
    with pytest.raises(HandedOn):
        with pause_on_termination(lambda name: None) as stop:
            stop.recorder = lambda cause, warn: recorded.append(cause)

            def body():
                stop.kill_at_once(lambda: killed.append("job"))
                os.kill(os.getpid(), signal.SIGTERM)
                wait_for(stop.requested.is_set, 10, "the first signal")
                os.kill(os.getpid(), signal.SIGTERM)
                campaign.wait(60)  # the job would go on: the stop at once does not wait for it

            supervise(body, stop, 60, lambda _: None)
    assert killed == ["job"] and recorded == [
        "campaign interrupted by SIGTERM, then stopped at once by a second signal"
    ]
    assert signal.getsignal(signal.SIGTERM) is previous_handler


def test_a_pause_that_outlasts_its_window_stops_at_once(prefect_like_handler, campaign):
    killed, recorded, notices = [], [], []
    with pytest.raises(HandedOn):
        with pause_on_termination(lambda name: None) as stop:
            stop.recorder = lambda cause, warn: recorded.append(cause)

            def body():
                stop.kill_at_once(lambda: killed.append("job"))
                os.kill(os.getpid(), signal.SIGTERM)
                campaign.wait(60)  # a saver stuck on a full disk

            supervise(body, stop, 1.0, notices.append, "the kill grace")
    assert killed == ["job"] and recorded == [
        "campaign interrupted by SIGTERM, then stopped at once when the kill grace (1s) ran out"
    ]
    assert notices[-1] == "the campaign did not pause within the kill grace (1s): stopping at once"


def test_outside_the_main_thread_nothing_is_installed(prefect_like_handler):
    seen = []

    def run():
        with pause_on_termination(lambda name: None) as stop:
            seen.append(stop)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [None] and signal.getsignal(signal.SIGTERM) is previous_handler


@pytest.mark.parametrize(
    "origin, cause, described",
    [
        (None, "SIGTERM received", "SIGTERM received"),  # a pod eviction, a worker shutting down
        ("cancelled from Prefect", "SIGTERM received", "cancelled from Prefect (SIGTERM from its worker)"),
        (
            "cancelled from Prefect",
            "campaign interrupted by SIGTERM, then stopped at once by a second signal",
            "campaign interrupted by SIGTERM (cancelled from Prefect), then stopped at once by a second signal",
        ),
    ],
)
def test_the_cause_names_where_the_signal_came_from(origin, cause, described):
    assert StopRequest(signum=signal.SIGTERM, origin=origin).describe(cause) == described


def test_a_run_is_being_cancelled_only_once_prefect_marks_it_cancelling(prefect_harness):
    @flow
    def probe() -> list[bool]:
        seen = [being_cancelled()]  # running: a SIGTERM now is an eviction, not Prefect's cancel
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run.get_id(), Cancelling(message="test"), force=True)
            seen.append(being_cancelled())
            client.set_flow_run_state(flow_run.get_id(), Running(), force=True)  # let the run end
        return seen

    assert probe() == [False, True]


def test_with_the_default_handler_before_the_stop_at_once_ends_the_process_by_sigterm(tmp_path):
    """A process with no handler of its own (SIGTERM at its default) ends as that default does
    once the stop at once is recorded: the exit status says SIGTERM, as to its supervisor."""
    script = f"""
import os, signal, threading
from pathlib import Path
from pretrain.run.stop import pause_on_termination, supervise
with pause_on_termination(lambda name: None) as stop:
    stop.recorder = lambda cause, warn: Path({str(tmp_path / "cause")!r}).write_text(cause)
    def body():
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(60)
    supervise(body, stop, 0.5, lambda _: None, "the window")
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert (
        tmp_path / "cause"
    ).read_text() == "campaign interrupted by SIGTERM, then stopped at once when the window (0s) ran out"


def test_a_keyboard_interrupt_of_the_supervising_thread_kills_the_job(campaign):
    killed = []
    stop = StopRequest()

    def body():
        stop.kill_at_once(lambda: killed.append("job"))
        os.kill(os.getpid(), signal.SIGINT)  # Python's default handler: KeyboardInterrupt in the main thread
        campaign.wait(60)

    with pytest.raises(KeyboardInterrupt):
        supervise(body, stop, 60, lambda _: None)
    assert killed == ["job"]
