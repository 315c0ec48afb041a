"""Time-boxed runs end to end: when the budget runs out mid-stage the campaign pauses at a
validated checkpoint (the run completes, nothing failed), and the next run continues it to the
same parameters, bit for bit, as one uninterrupted run. (The budget's pure logic: test_budget.)"""

from __future__ import annotations

import contextvars
import json
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from mlflow.tracking import MlflowClient
from test_chaos import final_model
from test_resume import SLOW_MODEL, assert_mlflow_steps_unique
from typer.testing import CliRunner

from flows.campaign import pretrain_campaign
from pretrain.cli.app import app
from pretrain.run.budget import PauseRequest, pausing
from pretrain.run.jobs import checkpoint_store
from support.campaigns import seed_data, small_spec, wait_for

STEPS = 60  # ~0.1 s a step: the budget runs out well before the stage's end, even on a loaded machine


def pause_spec(path, prepared_data):
    spec = small_spec(
        path,
        model=SLOW_MODEL,
        checkpoint={"interval": 10, "memory_interval": 5, "keep": 5},
        stages=[{"name": "main", "steps": STEPS, "seq_len": 64, "micro_batch": 8, "warmup_steps": 5}],
    )
    seed_data(spec, prepared_data)
    return spec


def run_until_budget_ends_after_first_checkpoint(spec) -> dict:
    """Run the campaign with a budget far off that runs out (now) once the first checkpoint of
    its stage ``main`` is committed: the deadline, not a request, makes it pause."""
    pause = PauseRequest(deadline=time.time() + 3600)
    with pausing(pause), ThreadPoolExecutor(1) as pool:
        run = pool.submit(contextvars.copy_context().run, pretrain_campaign, spec=spec)
        wait_for(lambda: checkpoint_store(spec, "main").read_pointer() or run.done(), 240, "the first checkpoint")
        pause.deadline = time.time()
        return run.result(timeout=300)


def test_a_time_boxed_run_pauses_and_the_next_run_completes_it_bit_exact(prefect_harness, prepared_data, tmp_path):
    spec = pause_spec(tmp_path / "boxed", prepared_data)
    status = run_until_budget_ends_after_first_checkpoint(spec)
    [stage] = status["stages"]
    assert (status["status"], stage["status"], stage["attempts"], stage["failures"]) == ("paused", "paused", 1, [])
    end = json.loads((spec.workdir_path / "ledger.json").read_text())["end"]
    step = end["step"]
    assert (end["state"], end["stage"]) == ("paused", "main") and 10 <= step < STEPS
    assert end["cause"].startswith(f"paused at main step {step}: the run's time budget ends at")
    assert stage["good_checkpoint"]["step"] == step  # the final save, judged good by the gate
    client = MlflowClient(spec.tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name(spec.tracking.experiment).experiment_id])
    assert {(r.info.status, r.data.tags["pretrain.end_state"]) for r in runs} == {("SCHEDULED", "paused")}

    status = pretrain_campaign(spec=spec)  # the next night: no budget, runs to the end
    [stage] = status["stages"]
    assert (status["status"], status["invocations"], stage["steps_done"]) == ("completed", 2, STEPS)
    [resumed] = [r for r in stage["resumes"] if r["attempt"] == 1]
    assert (resumed["source"], resumed["step"]) == ("checkpoint", step)
    _, runs = assert_mlflow_steps_unique(spec)  # the same runs go on; no step logged twice
    assert {r.info.status for r in runs} == {"FINISHED"}

    straight = pause_spec(tmp_path / "straight", prepared_data)
    assert pretrain_campaign(spec=straight)["status"] == "completed"
    a, b = final_model(spec), final_model(straight)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_run_refuses_a_budget_it_cannot_read(tmp_path):
    for args, says in (
        (["--for", "2 hours"], "--for '2 hours': expected a duration such as 2h"),
        (["--until", "6am"], "--until '6am': expected a time of day such as 06:00"),
    ):
        done = CliRunner().invoke(app, ["run", "builtin:tiny", "--workdir", str(tmp_path), *args])
        assert done.exit_code == 2, done.output
        assert says in " ".join(done.output.split()) and "Traceback" not in done.output
    assert not (tmp_path / "ledger.json").exists()  # refused before anything started
