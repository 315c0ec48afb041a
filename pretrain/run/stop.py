"""An operator's stop: Ctrl-C or SIGTERM to ``pretrain run``.

The first signal asks the campaign to pause (``pretrain.run.budget``, as a spent time budget does):
the running job is stopped with its savers' save at breakpoint, the gate judges it, the
campaign is recorded as *paused*, and the same command continues it. A second signal, or the
spec's ``resume.grace_period_s`` running out first, stops at once: the job's processes are
killed (a checkpoint in the making is never committed, so nothing is torn) and the campaign is
recorded *interrupted*.

A flow-run process started by a Prefect worker or runner (a deployment's run), or a pod, gets
the same from :func:`pause_on_termination`: Prefect's cancellation (the worker sends SIGTERM,
then SIGKILL 30 s later), a pod eviction or a worker shutting down pauses the campaign within
that window, and past it everything stops at once as before (the signal goes on to Prefect's
own handler).

The request travels in a context variable, not a module global: the CLI (or the flow) sets it in
the context the campaign flow runs in, and Prefect copies that context into its task threads, so
the training task sees it; a campaign run in a thread of its own (tests) sees none.
"""

from __future__ import annotations

import contextvars
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar


class CampaignInterrupted(RuntimeError):
    """The operator stopped the campaign; running the same command again resumes it."""

    def __init__(self, message: str, signum: int | None = None):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number."""
        return 128 + (self.signum or signal.SIGINT)


class CampaignPaused(CampaignInterrupted):
    """The signal paused the campaign cleanly (final checkpoint saved and validated, the ledger
    says *paused*); running the same command again continues it."""


class StoppedAtOnce(CampaignInterrupted):
    """A second signal: the job was killed at once; the flow may still be unwinding (exit now)."""


@dataclass
class StopRequest:
    """What the signals asked for, and what a second signal must kill at once."""

    signum: int | None = None  # the first signal received (None: no stop asked for)
    count: int = 0  # signals received
    flow_run: str | None = None  # the campaign run this process started (the ledger's ``flow_run``)
    origin: str | None = None  # who sent the signal, when known (e.g. "cancelled from Prefect")
    # how to record the interruption from another thread (a stop at once): set by the campaign
    # flow, run in the flow's context (its MLflow credentials); called with (cause, warn)
    recorder: Callable[[str, Callable[[str], None]], None] | None = None
    # called (in the signal handler, so it must not lock) with the first signal's name: `pretrain
    # run` asks the campaign to pause with it
    on_first: Callable[[str], None] | None = None
    requested: threading.Event = field(default_factory=threading.Event)
    urgent: threading.Event = field(default_factory=threading.Event)  # a second signal: stop now
    _kills: dict[object, Callable[[], None]] = field(default_factory=dict)
    # reentrant: the signal handler (:meth:`receive`) runs in the main thread, which may be inside
    # this lock at that moment when the campaign flow runs in the main thread (a flow-run process)
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _recorded: bool = False

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "no signal"

    def describe(self, cause: str) -> str:
        """``cause`` (``SIGTERM received``, ``... interrupted by SIGTERM, ...``) with the signal's
        :attr:`origin`, when known."""
        if not self.origin:
            return cause
        return cause.replace(f"{self.name} received", f"{self.origin} ({self.name} from its worker)", 1).replace(
            f"by {self.name}", f"by {self.name} ({self.origin})", 1
        )

    def receive(self, signum: int) -> None:
        """Called by the signal handler (main thread): the first asks, the second insists."""
        with self._lock:
            self.count += 1
            first = self.signum is None
            if first:
                self.signum = signum
        if first and self.on_first is not None:
            self.on_first(self.name)
        self.requested.set()
        if self.count > 1:
            self.urgent.set()

    def raise_if_requested(self, where: str) -> None:
        if self.requested.is_set():
            raise CampaignInterrupted(f"campaign interrupted by {self.name} {where}", self.signum)

    def kill_at_once(self, kill: Callable[[], None]) -> Callable[[], None]:
        """A second signal calls ``kill`` (e.g. SIGKILL a running job) until the returned
        function is called."""
        key = object()
        with self._lock:
            self._kills[key] = kill

        def forget() -> None:
            with self._lock:
                self._kills.pop(key, None)

        return forget

    def kill_now(self) -> None:
        with self._lock:
            kills = list(self._kills.values())
        for kill in kills:
            kill()

    def record_once(self, record: Callable[[], object]) -> bool:
        """Run ``record`` (write the interrupted state) unless it already ran; the flow and the
        CLI's hard stop never write the ledger at the same time. Returns whether it ran now."""
        with self._lock:
            if self._recorded:
                return False
            self._recorded = True
            record()
            return True


_CURRENT: contextvars.ContextVar[StopRequest | None] = contextvars.ContextVar("pretrain_stop_request", default=None)


def current_stop() -> StopRequest | None:
    """The stop request of the ``pretrain run`` this code runs under, if any."""
    return _CURRENT.get()


@contextmanager
def stop_on_signals(signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[StopRequest]:
    """Turn ``signums`` into a StopRequest for the block (call in the main thread, and run the
    campaign in a context copied inside it). A signal the process started with ignored (a
    background job started with SIGINT ignored) stays ignored."""
    stop = StopRequest()
    token = _CURRENT.set(stop)
    previous = {}
    for s in signums:
        if signal.getsignal(s) is not signal.SIG_IGN:
            previous[s] = signal.signal(s, lambda signum, _frame: stop.receive(signum))
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _CURRENT.reset(token)


class InterruptLatch:
    """Ctrl-C for a command that stops by ``KeyboardInterrupt`` (``pretrain data prepare``), made
    sure to land: SIGINT raises it at once as Python's default handler does, and is remembered,
    so that :meth:`check` (called at each progress report) raises it again if the first one hit a
    finalizer or a callback whose exceptions Python ignores (then the interrupt was printed as
    "Exception ignored" and the work went on to the end). Such an ignored interrupt is not printed:
    the latch has it."""

    def __init__(self) -> None:
        self.hit = False

    def _on_signal(self, signum, frame) -> None:
        self.hit = True
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.hit:
            raise KeyboardInterrupt


@contextmanager
def interrupt_latch(latch: InterruptLatch | None = None) -> Iterator[InterruptLatch]:
    """``latch`` (a new :class:`InterruptLatch` by default) for the block (main thread); SIGINT
    ignored at start stays so."""
    latch = latch or InterruptLatch()
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield latch
        return
    previous, previous_hook = signal.signal(signal.SIGINT, latch._on_signal), sys.unraisablehook

    def hook(unraisable) -> None:
        if not (latch.hit and isinstance(unraisable.exc_value, KeyboardInterrupt)):
            previous_hook(unraisable)

    sys.unraisablehook = hook
    try:
        yield latch
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = previous_hook


# what the stop at once needs before the infrastructure's SIGKILL lands: kill the job, record the
# campaign interrupted (ledger, MLflow), unwind the flow
STOP_AT_ONCE_S = 5.0
WAIT_S = 0.2  # how often the signals' thread looks at the stop request while the campaign runs

T = TypeVar("T")


def pause_window_s(grace_period_s: float, kill_grace_s: float) -> float:
    """How long a SIGTERM to a flow-run process leaves the pause: the spec's
    ``resume.grace_period_s``, but never past the infrastructure's kill grace (the time between
    its SIGTERM and its SIGKILL) less :data:`STOP_AT_ONCE_S`, so that a pause that does not finish
    in time still stops cleanly instead of being killed mid-way."""
    return max(1.0, min(grace_period_s, kill_grace_s - STOP_AT_ONCE_S))


def stop_at_once(stop: StopRequest, notice: Callable[[str], None], why: str = "by a second signal") -> StoppedAtOnce:
    """Kill the running job and record the campaign as interrupted (unless the flow already has)."""
    stop.kill_now()
    cause = f"campaign interrupted by {stop.name}, then stopped at once {why}"
    if stop.recorder is not None:  # None: the campaign never started
        stop.recorder(cause, notice)
    return StoppedAtOnce(cause, stop.signum)


def supervise(
    body: Callable[[], T],
    stop: StopRequest,
    grace_s: float,
    notice: Callable[[str], None],
    window: str = "resume.grace_period_s",
    again: str = "Ctrl-C or the same signal again",
    on_request: Callable[[], None] | None = None,
) -> T:
    """Run ``body`` (the campaign) in a thread, in a copy of this context, while this thread — the
    main one, which gets the signals — watches ``stop``: at the first signal it says the campaign
    is pausing (and calls ``on_request``, e.g. to find the signal's origin); a second signal, or
    ``grace_s`` (named ``window``) passing first, stops at once (:func:`stop_at_once`) and raises
    ``StoppedAtOnce`` without waiting for ``body``. Returns what ``body`` returned, raises what it
    raised. In a thread of its own the campaign's flows also leave the signal handlers alone:
    Prefect installs its SIGTERM handler only in the main thread (each subflow installs it again
    there, over any other)."""
    outcome: dict = {}
    context = contextvars.copy_context()

    def target() -> None:
        try:
            outcome["value"] = context.run(body)
        except BaseException as e:  # noqa: BLE001 - handed to this thread
            outcome["error"] = e

    thread = threading.Thread(target=target, name="campaign-flow", daemon=True)
    try:
        thread.start()
        _watch(thread, stop, grace_s, notice, window, again, on_request)
    except KeyboardInterrupt:  # a SIGINT left at Python's default (a flow run started from a terminal)
        stop.kill_now()  # the job ends with this process, not after it
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _watch(
    thread: threading.Thread,
    stop: StopRequest,
    grace_s: float,
    notice: Callable[[str], None],
    window: str,
    again: str,
    on_request: Callable[[], None] | None,
) -> None:
    """:func:`supervise`'s loop: until ``thread`` ends, or raises ``StoppedAtOnce``."""
    asked_at = None
    while thread.is_alive():
        thread.join(WAIT_S)
        if stop.urgent.is_set():
            notice(f"{stop.name} again: stopping at once")
            raise stop_at_once(stop, notice)
        if stop.requested.is_set() and asked_at is None:
            asked_at = time.monotonic()
            notice(
                f"{stop.name} received: pausing the campaign; the running job is stopping with a final checkpoint, "
                f"which is validated (up to {grace_s:.0f}s: {window}; {again} stops at once)"
            )
            if on_request is not None:
                on_request()
        if asked_at is not None and time.monotonic() - asked_at > grace_s:
            notice(f"the campaign did not pause within {window} ({grace_s:.0f}s): stopping at once")
            raise stop_at_once(stop, notice, f"when {window} ({grace_s:.0f}s) ran out")


@contextmanager
def pause_on_termination(on_first: Callable[[str], None]) -> Iterator[StopRequest | None]:
    """SIGTERM to a process whose main thread runs the campaign flow (a deployment's flow-run
    process, a pod): the first calls ``on_first`` with its name (ask the campaign to pause), as
    ``pretrain run``'s first signal does; run the campaign under :func:`supervise`. A
    ``StoppedAtOnce`` leaving the block hands the signal on to the handler installed before —
    Prefect's: the flow run ends cancelled or crashed, as it did before this handler existed; the
    default: the process ends. Yields the stop request (also :func:`current_stop`), or None where
    nothing was installed: not the main thread, or SIGTERM ignored."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) in (
        signal.SIG_IGN,
        None,
    ):
        yield None
        return
    stop = StopRequest(on_first=on_first)
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: stop.receive(signum))
    token = _CURRENT.set(stop)
    try:
        yield stop
    except StoppedAtOnce:
        signal.signal(signal.SIGTERM, previous)
        if callable(previous):
            previous(signal.SIGTERM, None)  # Prefect's raises TerminationSignal
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGTERM)
        raise
    finally:
        _CURRENT.reset(token)
        signal.signal(signal.SIGTERM, previous)
