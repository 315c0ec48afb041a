"""An operator's stop: Ctrl-C or SIGTERM to ``pretrain run``.

The first signal asks the campaign to pause (``pretrain.budget``, as a spent time budget does):
the running job is stopped with its savers' save at breakpoint, the gate judges it, the
campaign is recorded as *paused*, and the same command continues it. A second signal, or the
spec's ``resume.grace_period_s`` running out first, stops at once: the job's processes are
killed (a checkpoint in the making is never committed, so nothing is torn) and the campaign is
recorded *interrupted*.

The request travels in a context variable, not a module global: the CLI sets it in the
context the campaign flow runs in, and Prefect copies that context into its task threads, so
the training task sees it; a campaign run any other way (tests, deployments) sees none.
"""

from __future__ import annotations

import contextvars
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


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
    # how to record the interruption from another thread (a stop at once): set by the campaign
    # flow, run in the flow's context (its MLflow credentials); called with (cause, warn)
    recorder: Callable[[str, Callable[[str], None]], None] | None = None
    # called (in the signal handler, so it must not lock) with the first signal's name: `pretrain
    # run` asks the campaign to pause with it
    on_first: Callable[[str], None] | None = None
    requested: threading.Event = field(default_factory=threading.Event)
    urgent: threading.Event = field(default_factory=threading.Event)  # a second signal: stop now
    _kills: dict[object, Callable[[], None]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _recorded: bool = False

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "no signal"

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
