"""Checkpoint tasks: the validation gate (in its own process) and where a stage resumes."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pretrain.checkpoints.gate import judge, rewind_past_bad, wants_eval
from pretrain.run.jobs import checkpoint_store
from pretrain.settings import PretrainSettings
from pretrain.spec.campaign import CampaignSpec
from pretrain.state.ledger import Ledger
from pretrain.state.schema import Rewind, VerdictRecord
from pretrain.tracking.runs import describe_error, transient
from tasks.events import checkpoint_verdict
from tasks.tracking import mark_mlflow_behind, tracker_for


@task(name="judge-checkpoints", cache_policy=NO_CACHE)
def check_checkpoints(
    spec: CampaignSpec,
    stage_index: int,
    steps: list[int],
    evaluate: list[int] = (),
    settings: PretrainSettings | None = None,
) -> list[dict]:
    """Judge checkpoints of a stage in a separate process; record each verdict next to it, in
    the ledger, as MLflow tags and as an event (evaluation metrics, if run, at its step). One the
    gate could not judge now (verdict "unjudged") is only logged: it stays pending."""
    logger = get_run_logger()
    stage = spec.stages[stage_index].name
    records = judge(spec, stage_index, list(steps), set(evaluate), settings=settings)
    for record in records:
        if record["verdict"] == "unjudged":
            logger.warning(
                "stage %s: checkpoint %d could not be judged now; the next gate pass retries: %s",
                stage,
                record["step"],
                "; ".join(record["problems"]),
            )
            continue
        if record["verdict"] == "good":
            logger.info(
                "stage %s: checkpoint %d is good (probe loss %s)",
                stage,
                record["step"],
                _fmt(record["probe"].get("probe_loss")),
            )
        else:
            logger.error(
                "stage %s: checkpoint %d is BAD, never resumed from: %s",
                stage,
                record["step"],
                "; ".join(record["problems"]),
            )
        record_verdict(spec, stage_index, record)
    return records


def record_verdict(spec: CampaignSpec, stage_index: int, record: dict) -> None:
    """The verdict goes to the ledger, the stage's MLflow run (tags; evaluation metrics at the
    checkpoint's step) and out as a ``pretrain.checkpoint.good/bad`` event."""
    stage = spec.stages[stage_index].name
    checkpoint_verdict(spec, stage, record["path"], record)
    ledger = Ledger.open(spec)
    ledger.record_verdict(
        stage,
        VerdictRecord(**{k: record[k] for k in ("step", "path", "verdict", "problems", "probe", "metrics", "time")}),
    )
    run_id = ledger.stage(stage).mlflow_run_id
    if run_id:
        try:
            tracker_for(spec).check()  # one quick request: the gate never waits MLflow's minutes of retries
            verdicts_to_mlflow(spec, run_id, [record])
        except Exception as e:  # noqa: BLE001 - MLflow is a view: the verdict stands; the stage's end sends it
            if not transient(e):
                raise
            mark_mlflow_behind(
                ledger,
                "stage %s: MLflow did not take the verdict of checkpoint %d (%s); it is sent again when the stage ends",
                stage,
                record["step"],
                describe_error(e),
            )


def verdicts_to_mlflow(spec: CampaignSpec, run_id: str, records: list[dict]) -> None:
    """Verdicts as tags of the stage run, evaluation metrics at their steps (idempotent: tags
    are overwritten with the same value, a metric the run holds at that step is not logged again)."""
    tracker = tracker_for(spec)
    tags = {}
    for record in records:
        tags[f"verdict.{record['step']:08d}"] = record["verdict"]
        if record["problems"]:
            tags[f"verdict.{record['step']:08d}.problems"] = "; ".join(record["problems"])[:4000]
    if tags:
        tracker.set_tags(run_id, tags)
    if by_step := {record["step"]: record["metrics"] for record in records if record.get("metrics")}:
        tracker.log_values_at_steps(run_id, by_step)


def judge_pending(spec: CampaignSpec, stage_index: int, settings: PretrainSettings | None = None) -> list[dict]:
    """Judge every committed checkpoint of the stage that has no verdict yet, oldest first."""
    steps = checkpoint_store(spec, spec.stages[stage_index].name).unjudged()
    if not steps:
        return []
    return check_checkpoints(spec, stage_index, steps, [s for s in steps if wants_eval(spec, stage_index, s)], settings)


@task(name="find-resume-point", cache_policy=NO_CACHE)
def find_resume_point(spec: CampaignSpec, stage_index: int) -> dict | None:
    """The stage's newest *good* checkpoint (None: the stage starts fresh). Judges what is not
    judged yet first; if the pointer got beyond the newest good checkpoint, rewinds to it."""
    judge_pending(spec, stage_index)
    store = checkpoint_store(spec, spec.stages[stage_index].name)
    rewound = rewind_past_bad(store)
    if rewound:
        get_run_logger().warning(
            "stage %s: rewound from step %s to the last good checkpoint %s (bad ones quarantined: %s)",
            spec.stages[stage_index].name,
            rewound["from"],
            rewound["to"],
            [q["path"] for q in rewound["quarantined"]] or "none",
        )
        Ledger.open(spec).record_rewind(spec.stages[stage_index].name, Rewind(**rewound))
    ref = store.latest_good()
    return None if ref is None else ref.to_dict()


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.4f}"
