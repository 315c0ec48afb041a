"""A run's time budget: reading --for / --until, the margin kept for the final checkpoint (from
the campaign's own measured times), when the pause is due, and the policy's answer to a job
stopped for it. Pure logic, table-driven; the campaign-level pause is in tests/scenarios/test_pause.py."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from test_policy import failed

from pretrain.run.budget import (
    STOP_OVERHEAD_S,
    UNMEASURED_MARGIN_S,
    BudgetError,
    PauseRequest,
    deadline,
    margin_s,
    measured_times,
    parse_duration,
    parse_until,
)
from pretrain.run.policy import PAUSED, Action, Budget, after_job
from pretrain.state.schema import VerdictRecord

NOW = datetime(2026, 12, 1, 22, 30, tzinfo=timezone(timedelta(hours=1)))


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("2h", 7200),
        ("90m", 5400),
        ("1h30m", 5400),
        ("45s", 45),
        ("1d", 86400),
        ("0.5h", 1800),
        ("600", 600),
        (" 4h 30m ", 16200),
    ],
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "2 hours", "h", "-5m", "0", "0s", "2x", "1h-30m"])
def test_bad_durations_say_what_is_expected(text):
    with pytest.raises(BudgetError, match=r"--for .*(expected a duration|must be positive)"):
        parse_duration(text)


@pytest.mark.parametrize(
    "text, end",
    [
        ("06:00", NOW.replace(day=2, hour=6, minute=0)),  # past today's 06:00: tomorrow's
        ("23:15", NOW.replace(hour=23, minute=15)),  # later today
        ("22:30", NOW.replace(day=2)),  # exactly now: the next one
        ("7:05:30", NOW.replace(day=2, hour=7, minute=5, second=30)),
        ("2026-12-02T06:00", NOW.replace(day=2, hour=6, minute=0)),  # naive: the caller's zone
        ("2026-12-02T05:00+00:00", NOW.replace(day=2, hour=6, minute=0)),
    ],
)
def test_until(text, end):
    assert parse_until(text, NOW) == end


@pytest.mark.parametrize(
    "text, says",
    [
        ("25:00", "not a time of day"),
        ("6am", "expected a time of day"),
        ("2026-11-30T06:00", "has passed"),
    ],
)
def test_bad_until_says_why(text, says):
    with pytest.raises(BudgetError, match=says):
        parse_until(text, NOW)


@pytest.mark.parametrize(
    "run_for, until, after_s",
    [
        (None, None, None),
        ("1h", None, 3600),
        (None, "23:00", 1800),
        ("1h", "23:00", 1800),  # both: the earlier end
        ("10m", "23:00", 600),
    ],
)
def test_deadline(run_for, until, after_s):
    end = deadline(run_for, until, NOW)
    assert (None if end is None else end - NOW.timestamp()) == after_s


@pytest.mark.parametrize(
    "persist, gate, budget, margin",
    [
        ([], [], None, UNMEASURED_MARGIN_S),  # nothing measured yet: the documented floor
        ([], [], 7200, UNMEASURED_MARGIN_S),
        ([], [], 240, 120),  # ... at most half a short budget: a first short run still trains (and measures)
        ([1.0, 3.0, 2.0], [], None, 2 * 3.0 + STOP_OVERHEAD_S),  # the slowest persist, doubled
        ([], [10.0], 60, 2 * 10.0 + STOP_OVERHEAD_S),  # measured: the budget does not shrink it
        ([2.0], [4.0, 6.0], None, 2 * (2.0 + 6.0) + STOP_OVERHEAD_S),
    ],
)
def test_margin_is_the_campaigns_measured_persist_and_validation_times(persist, gate, budget, margin):
    assert margin_s(persist, gate, budget) == margin


def test_the_budget_counts_from_when_it_was_given():
    assert PauseRequest(deadline=NOW.timestamp() + 600, started=NOW.timestamp()).budget_s == 600
    assert PauseRequest().budget_s is None


def test_measured_times_come_from_the_jobs_events_and_the_verdicts(tmp_path):
    """Persist times from every attempt's events (a damaged line skipped), validation times from
    the verdicts that have one (a verdict of the release before has none)."""
    for attempt, lines in (
        ("attempt_000", [{"event": "persisted", "step": 4, "persist_s": 1.5}, {"event": "checkpoint", "step": 4}]),
        ("attempt_001", [{"event": "persisted", "step": 8, "persist_s": 2.5}]),
    ):
        (tmp_path / attempt).mkdir()
        text = "".join(json.dumps(e) + "\n" for e in lines)
        (tmp_path / attempt / "events.jsonl").write_text(
            text + ('{"event": "persi' if attempt == "attempt_001" else "")
        )
    verdicts = [
        VerdictRecord(step=4, path="p", verdict="good", gate_s=3.0),
        VerdictRecord(step=8, path="p", verdict="good"),
    ]
    assert measured_times(tmp_path, verdicts) == ([1.5, 2.5], [3.0])
    assert measured_times(tmp_path / "no-jobs-yet", []) == ([], [])


@pytest.mark.parametrize(
    "deadline_in_s, margin, asked, due",
    [
        (None, 60, None, False),  # no budget: never
        (3600, 60, None, False),
        (61, 60, None, False),
        (60, 60, None, True),  # the margin reached
        (-5, 60, None, True),  # past the end
        (None, 60, "asked", True),  # asked for, budget or not
    ],
)
def test_the_pause_is_due_at_the_deadline_less_the_margin(deadline_in_s, margin, asked, due):
    now = NOW.timestamp()
    pause = PauseRequest(deadline=None if deadline_in_s is None else now + deadline_in_s, margin_s=margin)
    if asked:
        pause.ask(asked)
    why = pause.due(now)
    assert bool(why) == due
    if due and not asked:
        assert "time budget ends at" in why and f"{margin}s kept for the final checkpoint" in why


def test_a_short_first_budget_trains_before_anything_is_measured():
    """Before the first stage launches nothing is measured: a 60 s budget keeps 30 s (half of
    it), not the 300 s of an unmeasured campaign, which paused every such run at once."""
    pause = PauseRequest(deadline=NOW.timestamp() + 60, started=NOW.timestamp())
    assert pause.due(NOW.timestamp() + 29) is None
    assert "30s kept for the final checkpoint" in pause.due(NOW.timestamp() + 30)


def test_a_job_stopped_to_pause_is_no_failure_and_costs_no_attempt():
    decision = after_job(failed(PAUSED), 1, Budget(1, 1))
    assert (decision.action, decision.failure, decision.budget) == (Action.PAUSE, None, Budget(1, 1))
