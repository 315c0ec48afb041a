"""A run's time budget (``pretrain run --for 2h`` / ``--until 06:00``) and the pause it ends in.

A time-boxed run trains until its budget is near, then *pauses*: the running job is stopped
with its savers' save at breakpoint (snapshot → persist), the validation gate judges the
checkpoint, and the campaign is recorded ``paused at <stage> step N``; the flow run ends
Completed and the next run continues from there. The margin kept for that final checkpoint is
this campaign's own measured persist and validation times (:func:`margin_s`), so a campaign
with big checkpoints stops earlier than a tiny one.

The pause is asked for through a :class:`PauseRequest` in a context variable (like the
operator's stop in ``pretrain.run.stop``): the campaign flow sets it, Prefect copies the context
into its subflows and task threads, and the training task polls it while its job runs.
"""

from __future__ import annotations

import contextvars
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

# the margin when this campaign has measured nothing yet (its first checkpoint): room for a
# persist and a validation of a checkpoint of a few GB on slow storage
UNMEASURED_MARGIN_S = 300.0
# what the job's stop itself takes (SIGTERM, processes exiting) on top of the measured times
STOP_OVERHEAD_S = 15.0
SAFETY = 2.0  # the measured times are doubled: the final checkpoint may be slower than the typical one

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)([smhd]))+$")


class BudgetError(ValueError):
    """A time budget that cannot be read (says what is expected)."""


def parse_duration(text: str) -> float:
    """Seconds of ``2h``, ``90m``, ``1h30m``, ``45s``, ``1d`` or a plain number of seconds."""
    s = text.strip().lower().replace(" ", "")
    try:
        seconds = float(s)
    except ValueError:
        if not _DURATION.match(s):
            raise BudgetError(f"--for {text!r}: expected a duration such as 2h, 90m, 1h30m or 45s") from None
        seconds = sum(float(n) * _UNITS[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([smhd])", s))
    if seconds <= 0:
        raise BudgetError(f"--for {text!r}: the duration must be positive")
    return seconds


def parse_until(text: str, now: datetime) -> datetime:
    """The end of ``--until``: ``06:00`` (the next 06:00 after ``now``, in ``now``'s time zone) or
    an ISO date and time (``2026-12-02T06:00``, ``...+00:00``)."""
    s = text.strip()
    m = re.fullmatch(r"(\d{1,2}):(\d{2})(?::(\d{2}))?", s)
    if m:
        h, mi, se = int(m[1]), int(m[2]), int(m[3] or 0)
        if h > 23 or mi > 59 or se > 59:
            raise BudgetError(f"--until {text!r}: not a time of day (HH:MM)")
        end = now.replace(hour=h, minute=mi, second=se, microsecond=0)
        return end if end > now else end + timedelta(days=1)
    try:
        end = datetime.fromisoformat(s)
    except ValueError:
        raise BudgetError(
            f"--until {text!r}: expected a time of day such as 06:00 or an ISO date and time such as 2026-12-02T06:00"
        ) from None
    if end.tzinfo is None:
        end = end.replace(tzinfo=now.tzinfo)
    if end <= now:
        raise BudgetError(f"--until {text!r}: that time has passed")
    return end


def deadline(run_for: str | None, until: str | None, now: datetime | None = None) -> float | None:
    """The run's end (epoch seconds) from ``--for`` and/or ``--until`` (both: the earlier);
    None: no budget."""
    now = now or datetime.now().astimezone()
    ends = []
    if run_for:
        ends.append(now.timestamp() + parse_duration(run_for))
    if until:
        ends.append(parse_until(until, now).timestamp())
    return min(ends) if ends else None


def margin_s(persist_s: list[float], gate_s: list[float], budget_s: float | None = None) -> float:
    """Seconds before the deadline at which the job is stopped: the slowest persist and the
    slowest validation this campaign measured, doubled, plus the stop itself; with nothing
    measured yet, :data:`UNMEASURED_MARGIN_S` — at most half the run's budget ``budget_s``, so
    that a short first run still trains (and measures) instead of pausing at once, every time."""
    if not persist_s and not gate_s:
        return UNMEASURED_MARGIN_S if budget_s is None else min(UNMEASURED_MARGIN_S, budget_s / 2)
    return SAFETY * (max(persist_s, default=0.0) + max(gate_s, default=0.0)) + STOP_OVERHEAD_S


def measured_times(jobs_dir: Path, verdicts: list) -> tuple[list[float], list[float]]:
    """This stage's measured persist times (its jobs' ``persisted`` events) and validation times
    (its verdicts' ``gate_s``). Unreadable lines are skipped: a budget never fails a run."""
    from trainer.job.events import EventKind
    from trainer.job.reporting import EVENTS, read_all

    persist: list[float] = []
    for events in sorted(jobs_dir.glob(f"attempt_*/{EVENTS}")):
        try:
            persist += [
                float(e["persist_s"])
                for e in read_all(events)
                if e.get("event") == EventKind.PERSISTED and isinstance(e.get("persist_s"), (int, float))
            ]
        except (OSError, ValueError):
            continue
    gate = [float(g) for v in verdicts if isinstance(g := getattr(v, "gate_s", None), (int, float))]
    return persist, gate


@dataclass
class PauseRequest:
    """When the running campaign must pause: at ``deadline`` less ``margin_s`` (the training task
    updates the margin from measurements), or at once once :meth:`ask` was called."""

    deadline: float | None = None  # epoch seconds; None: no time budget
    margin_s: float | None = None  # None: nothing measured yet (the unmeasured margin, at most half the budget)
    started: float = field(default_factory=time.time)  # when the budget started counting
    asked: str | None = None  # why a pause was asked for outside the budget (the first reason stands)

    @property
    def budget_s(self) -> float | None:
        """The run's whole budget in seconds (None: none)."""
        return None if self.deadline is None else self.deadline - self.started

    def ask(self, reason: str) -> None:
        """Pause now. Safe in a signal handler: a plain assignment, no lock (the handler may run
        while its own thread is inside any lock)."""
        if self.asked is None:
            self.asked = reason

    def due(self, now: float | None = None) -> str | None:
        """Why the campaign must pause now (None: it may go on)."""
        if self.asked:
            return self.asked
        kept = self.margin_s if self.margin_s is not None else margin_s([], [], self.budget_s)
        if self.deadline is not None and (now or time.time()) >= self.deadline - kept:
            end = datetime.fromtimestamp(self.deadline).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
            return f"the run's time budget ends at {end} ({kept:.0f}s kept for the final checkpoint)"
        return None


_CURRENT: contextvars.ContextVar[PauseRequest | None] = contextvars.ContextVar("pretrain_pause_request", default=None)


def current_pause() -> PauseRequest | None:
    """The pause request of the campaign run this code runs under, if any."""
    return _CURRENT.get()


@contextmanager
def pausing(request: PauseRequest) -> Iterator[PauseRequest]:
    """Make ``request`` the current pause request for the block."""
    token = _CURRENT.set(request)
    try:
        yield request
    finally:
        _CURRENT.reset(token)
