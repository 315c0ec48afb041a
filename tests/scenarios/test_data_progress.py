"""What a person sees of data preparation's progress: the display (a bar on a terminal, lines
elsewhere, human numbers) and a Ctrl-C stopping it at the next report. The rest (``pretrain data
prepare`` / ``inspect``, the flow's Prefect artifact and MLflow input): ``test_data_ux.py``."""

from __future__ import annotations

import io
import signal

import pytest

from pretrain.cli.data import show_on
from pretrain.console_progress import LineProgress, clock_time, human, progress_display
from pretrain.data.prepare.progress import PrepProgress
from pretrain.run.stop import InterruptLatch, interrupt_latch


@pytest.mark.parametrize(
    "n, unit, text",
    [
        (0, "", "0"),
        (999, "", "999"),
        (1234, "", "1.2k"),
        (2_500_000, "", "2.5M"),
        (3e9, "", "3.0G"),
        (512, "B", "512 B"),
        (1_200_000, "B", "1.2 MB"),
        (0.5, "", "0.5"),
    ],
)
def test_human_numbers(n, unit, text):
    assert human(n, unit) == text


@pytest.mark.parametrize("seconds, text", [(0, "0:00:00"), (59.6, "0:01:00"), (3725, "1:02:05")])
def test_clock_time(seconds, text):
    assert clock_time(seconds) == text


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_off_a_terminal_a_line_per_stage_then_one_per_interval_with_rates_and_eta():
    clock, lines = FakeClock(), []
    display = LineProgress("data", lines.append, unit="B", rated=("tokens",), interval_s=10, clock=clock)
    display.update(0, 0, "scan")
    display.update(0, 0, "tokenizer")
    for i in range(1, 9):  # 2 MB and 500k tokens every 5 s
        clock.now += 5
        display.update(i * 2_000_000, 16_000_000, "tokenize", tokens=i * 500_000)
    display.close()
    assert lines[:2] == ["data: scan", "data: tokenizer"]
    # the first tokenize line comes at once (new stage), then one per 10 s, then the final state
    assert [line.split(" ")[2] for line in lines[2:]] == ["12%", "38%", "62%", "88%", "100%"]
    assert "2.0 MB/16.0 MB" in lines[2]
    assert "(400.0 kB/s)" in lines[3] and "tokens 1.5M (100.0k/s)" in lines[3] and "ETA 0:00:25" in lines[3]
    assert lines[-1] == "data: tokenize 100% 16.0 MB/16.0 MB, tokens 4.0M"  # final: totals, no rates


def test_close_repeats_nothing_already_shown():
    lines = []
    display = LineProgress("data", lines.append, clock=FakeClock())
    display.update(5, 10, "tokenize")
    display.close()
    assert lines == ["data: tokenize 50% 5/10"]


def test_the_display_is_a_bar_on_a_terminal_and_lines_elsewhere():
    stream = io.StringIO()
    lines = progress_display("data", stream=stream, interval_s=0)
    lines.update(1, 2, "tokenize", tokens=3)
    lines.close()
    assert stream.getvalue() == "data: tokenize 50% 1/2, tokens 3\n"
    screen = io.StringIO()
    bar = progress_display("data", stream=screen, tty=True)
    assert screen.getvalue() == ""  # nothing shows (or animates) before the work reports
    try:
        bar.update(1, 2, "tokenize", tokens=3)
    finally:
        bar.close()
    assert "data: tokenize" in screen.getvalue() and "1/2, tokens 3" in screen.getvalue()


class _CtrlCWhileFinalized:
    """An object whose finalizer is running when Ctrl-C arrives (a CI run: the interrupt landed in
    a finalizer, Python printed it as "Exception ignored" and `pretrain data prepare` went on to
    the end, exit 0)."""

    def __del__(self):
        signal.raise_signal(signal.SIGINT)


def test_a_ctrl_c_that_lands_in_a_finalizer_still_stops_at_the_next_progress_report(capsys):
    lines = []
    show = show_on(LineProgress("data", lines.append, interval_s=0), latch := InterruptLatch())
    show(PrepProgress("scan"))
    with interrupt_latch(latch):
        _CtrlCWhileFinalized()  # collected at once: the interrupt is raised inside __del__ and ignored there
        with pytest.raises(KeyboardInterrupt):
            show(PrepProgress("tokenize"))
    assert len(lines) == 1  # stopped before drawing anything more
    assert "Traceback" not in capsys.readouterr().err  # the ignored interrupt is not printed at the user
    with pytest.raises(KeyboardInterrupt):  # outside a finalizer it stops at once, as Python's own handler does
        with interrupt_latch():
            signal.raise_signal(signal.SIGINT)
