"""A progress display for long commands: a rich bar (rates, ETA) on a terminal, a plain line every
few seconds otherwise (a log file, CI, ``kubectl logs``), so the same code reports either way.

Generic on purpose: it shows ``done`` of ``total`` (bytes or plain counts), a stage name and any
numeric fields, with a per-second rate for the fields named ``rated``. Data preparation feeds it
bytes and tokens; training progress can feed it steps and tokens.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TextIO

RATE_WINDOW_S = 30.0  # rates and the ETA follow the last this-many seconds, not the whole run


class ProgressDisplay(Protocol):
    def update(self, done: float, total: float, stage: str = "", **fields: float | str) -> None:
        """The work is at ``done`` of ``total`` (0: unknown), in ``stage``; ``fields`` are cumulative
        counts (shown with a rate when named in ``rated``) or text shown as it is."""

    def note(self, text: str) -> None:
        """Something happened (a recovery): one line of its own, kept above a bar."""

    def close(self) -> None:
        """The work ended: show where it ended, release the terminal."""


def human(n: float, unit: str = "") -> str:
    """``1234567`` → ``1.2M``; with unit ``B``: ``1.2 MB``."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{' ' if unit else ''}{suffix}{unit}"
    return f"{n:.0f}{' ' if unit else ''}{unit}" if n == int(n) else f"{n:.1f}{unit}"


def clock_time(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


@dataclass
class Rates:
    """Per-second rates of cumulative counts over a sliding window of samples."""

    window_s: float = RATE_WINDOW_S
    samples: deque = field(default_factory=deque)  # (time, {name: value})

    def add(self, now: float, values: dict[str, float]) -> None:
        self.samples.append((now, dict(values)))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()

    def rate(self, name: str) -> float | None:
        """None until two samples span some time."""
        (t0, first), (t1, last) = self.samples[0], self.samples[-1]
        if t1 <= t0 or name not in last:
            return None
        return max(0.0, (last[name] - first.get(name, 0.0)) / (t1 - t0))


@dataclass
class _Snapshot:
    done: float = 0.0
    total: float = 0.0
    stage: str = ""
    fields: dict[str, float | str] = field(default_factory=dict)


def describe(
    snap: _Snapshot,
    rates: Rates,
    unit: str,
    rated: tuple[str, ...],
    final: bool = False,
    percent: bool = True,
    estimates: bool = True,
) -> str:
    """``45% 12.3 MB/27.0 MB (1.2 MB/s), tokens 3.4M (280.0k/s), ETA 0:00:12`` (no rates once ``final``;
    no percentage where a bar shows it; no rate of ``done`` nor ETA without ``estimates``: the
    caller's fields carry its own)."""
    done_rate = None if final or not estimates else rates.rate("_done")
    head = (
        f"{human(snap.done, unit)}/{human(snap.total, unit)}"
        if snap.total
        else (human(snap.done, unit) if snap.done else "")
    )
    if snap.total and percent:
        head = f"{100 * min(1.0, snap.done / snap.total):.0f}% {head}"
    parts = [head + (f" ({human(done_rate, unit)}/s)" if done_rate else "")] if head else []
    for name, value in snap.fields.items():
        if isinstance(value, str):
            parts.append(f"{name} {value}")
            continue
        r = rates.rate(name) if name in rated and not final else None
        parts.append(f"{name} {human(value)}" + (f" ({human(r)}/s)" if r else ""))
    if snap.total and done_rate and snap.done < snap.total:
        parts.append(f"ETA {clock_time((snap.total - snap.done) / done_rate)}")
    return ", ".join(parts)


def _numbers(fields: dict) -> dict[str, float]:
    return {k: v for k, v in fields.items() if not isinstance(v, str)}


def line(title: str, snap: _Snapshot, text: str) -> str:
    return (f"{title}: {snap.stage} {text}" if snap.stage else f"{title}: {text}").rstrip()


class LineProgress:
    """Not a terminal: a line when the stage changes, then at most one every ``interval_s``, and
    the final state on close."""

    def __init__(
        self,
        title: str,
        write: Callable[[str], None],
        *,
        unit: str = "",
        rated: tuple[str, ...] = (),
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        estimates: bool = True,
    ):
        self.title, self.unit, self.rated, self.interval_s, self.clock = title, unit, rated, interval_s, clock
        self.estimates = estimates
        self.write = write
        self.rates, self.snap = Rates(), _Snapshot()
        self.last_line_at: float | None = None
        self.unwritten = False  # an update came since the last line

    def update(self, done: float, total: float, stage: str = "", **fields: float | str) -> None:
        now = self.clock()
        new_stage = stage != self.snap.stage
        self.snap, self.unwritten = _Snapshot(done, total, stage, dict(fields)), True
        self.rates.add(now, {"_done": done, **_numbers(fields)})
        if new_stage or self.last_line_at is None or now - self.last_line_at >= self.interval_s:
            self.write(
                line(
                    self.title,
                    self.snap,
                    describe(self.snap, self.rates, self.unit, self.rated, estimates=self.estimates),
                )
            )
            self.last_line_at, self.unwritten = now, False

    def note(self, text: str) -> None:
        self.write(text)

    def close(self) -> None:
        if self.unwritten:
            self.write(line(self.title, self.snap, describe(self.snap, self.rates, self.unit, self.rated, final=True)))
            self.unwritten = False


class BarProgress:
    """A terminal: a rich progress bar with the done/total, its rate, the fields and the ETA. It
    appears with the first update (nothing animates while the work has not started)."""

    def __init__(
        self,
        title: str,
        *,
        unit: str = "",
        rated: tuple[str, ...] = (),
        stream: TextIO | None = None,
        estimates: bool = True,
    ):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

        self.title, self.unit, self.rated, self.estimates = title, unit, rated, estimates
        self.rates, self.snap = Rates(), _Snapshot()
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=24),
            TaskProgressColumn(),
            TextColumn("{task.fields[line]}"),
            console=Console(file=stream or sys.stderr),
        )
        self.console = self.progress.console  # print through it while the bar shows, above the bar
        self.task = self.progress.add_task(title, total=None, line="")
        self.started = False

    def update(self, done: float, total: float, stage: str = "", **fields: float | str) -> None:
        if not self.started:
            self.progress.start()
            self.started = True
        self.snap = _Snapshot(done, total, stage, dict(fields))
        self.rates.add(time.monotonic(), {"_done": done, **_numbers(fields)})
        self.progress.update(
            self.task,
            completed=done,
            total=total or None,
            description=f"{self.title}: {stage}" if stage else self.title,
            line=describe(self.snap, self.rates, self.unit, self.rated, percent=False, estimates=self.estimates),
        )

    def note(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False)

    def close(self) -> None:
        if self.started:
            self.progress.stop()
            self.started = False


def progress_display(
    title: str,
    *,
    unit: str = "",
    rated: tuple[str, ...] = (),
    stream: TextIO | None = None,
    interval_s: float = 10.0,
    tty: bool | None = None,
    estimates: bool = True,
) -> ProgressDisplay:
    """A bar when ``stream`` (default stderr) is a terminal (or ``tty``), else periodic lines on it.
    ``estimates``: the display computes the rate of ``done`` and an ETA (False: the fields carry them)."""
    stream = stream or sys.stderr
    if tty if tty is not None else stream.isatty():
        return BarProgress(title, unit=unit, rated=rated, stream=stream, estimates=estimates)

    def write(text: str) -> None:  # not print(): a Prefect run with log_prints would take it as a log
        stream.write(text + "\n")
        stream.flush()

    return LineProgress(title, write, unit=unit, rated=rated, interval_s=interval_s, estimates=estimates)
