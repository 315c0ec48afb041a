"""Loss-anomaly detection and skip windows (pure functions), the rollback limit of a job (one
real node agent); the campaign-level rollback is in test_chaos.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pretrain.run.incidents import cause_of
from support.agents import agent_job, node_log, run_agent
from trainer.job.reporting import EVENTS, read_all
from trainer.resilience.anomaly import SpikeDetector, skip_past


def test_nan_and_inf_are_caught_from_the_first_step():
    d = SpikeDetector(window=10, zscore=6.0, min_steps=5)
    assert d.check(float("nan")) == "nonfinite" and d.check(math.inf) == "nonfinite"


def test_spike_is_judged_against_the_trailing_median_and_mad():
    d = SpikeDetector(window=20, zscore=6.0, min_steps=10)
    falling = [5.0 - 0.05 * i + (0.02 if i % 2 else -0.02) for i in range(20)]
    assert [d.check(x) for x in falling] == [None] * 20  # a normal, noisy, falling loss
    assert d.check(falling[-1] + 0.1) is None  # within the noise band
    assert d.check(falling[-1] * 3) == "spike"
    assert d.check(falling[-1]) is None  # the spike did not enter the window


def test_no_judgement_before_min_steps_and_zscore_zero_disables():
    early = SpikeDetector(window=20, zscore=6.0, min_steps=10)
    assert [early.check(x) for x in (5.0, 5.1, 50.0)] == [None, None, None]
    off = SpikeDetector(window=20, zscore=0.0, min_steps=2)
    assert [off.check(x) for x in [1.0] * 5 + [1e6]] == [None] * 6


def test_skip_past_steps_over_every_window_it_lands_in():
    windows = [(16, 24), (24, 32), (48, 56)]
    assert skip_past(8, windows) == 8
    assert skip_past(16, windows) == 32  # adjacent windows chain
    assert skip_past(50, windows) == 56


@pytest.mark.parametrize(
    "in_process, errors",
    [
        (True, ["TooManyRollbacks", "TooManyRollbacks"]),  # the live worker refuses to roll back, then its restart does
        (False, ["LossAnomaly", "TooManyRollbacks"]),  # the NaN step ends the worker, the restarted one refuses
    ],
)
def test_too_many_rollbacks_fail_the_job_saying_which_setting_to_raise(
    prepared_data, tmp_path, zygote, in_process, errors
):
    """A NaN step with ``max_rollbacks: 0``: whether rolled back inside the live workers or by
    restarting them, the worker refuses to go on; the job fails with the cause the stage policy
    stops on (``too_many_rollbacks`` → give up, no relaunch: tests/unit/test_policy.py)."""
    job = agent_job(
        tmp_path,
        prepared_data,
        steps=6,
        sections={
            "chaos": [{"kind": "nan_loss", "step": 3}],
            "fault_tolerance": {"max_rollbacks": 0, "rollback_in_process": in_process},
        },
    )
    assert run_agent(job, max_restarts=1, zygote=zygote) == 1, node_log(job)
    events = read_all(Path(job.job_dir) / EVENTS)
    assert [e["kind"] for e in events if e["event"] == "anomaly"] == ["nonfinite"]
    assert [e["error_type"] for e in events if e["event"] == "error"] == errors
    refused = [e for e in events if e["event"] == "error"][-1]
    assert "1 loss anomalies in stage s (max_rollbacks=0)" in refused["error"]
    assert "raise fault_tolerance.max_rollbacks" in refused["error"]
    assert cause_of(events, 1) == "too_many_rollbacks"
