"""Custom Prefect events of a campaign, each with the campaign as its resource
(``pretrain.campaign.<name>``), so automations can react to them:

- ``pretrain.checkpoint.good`` / ``pretrain.checkpoint.bad``  a checkpoint passed / failed validation
- ``pretrain.stage.restarted``  a stage's workers restarted inside a job (``recovery_path``: restart, or
  spare / replacement: lost workers replaced, the others kept; a hung worker's ``where``), or its
  job was launched again
- ``pretrain.stage.failed``     a stage gave up
- ``pretrain.campaign.completed``  every stage is done

Checkpoint events also label their resource ``pretrain.checkpoint.final`` ("true" for a stage's
last checkpoint). ``prefect.yaml`` ships a trigger that runs the evaluation deployment on
``pretrain.checkpoint.good`` of final checkpoints (one evaluation per stage, not one per
checkpoint; the gate already evaluates every ``validation.eval_every``-th during training).
"""

from __future__ import annotations

from prefect.events import emit_event

from pretrain.data.campaign import campaign_data
from pretrain.run.incidents import where_hung
from pretrain.spec.campaign import CampaignSpec
from pretrain.state.ledger import LedgerError
from trainer.data.manifest import DataError
from trainer.job.events import REPLACEMENT_PATHS

CHECKPOINT_GOOD = "pretrain.checkpoint.good"
CHECKPOINT_BAD = "pretrain.checkpoint.bad"
STAGE_RESTARTED = "pretrain.stage.restarted"
STAGE_FAILED = "pretrain.stage.failed"
CAMPAIGN_COMPLETED = "pretrain.campaign.completed"
FINAL_LABEL = "pretrain.checkpoint.final"


def campaign_resource(spec: CampaignSpec) -> dict[str, str]:
    return {
        "prefect.resource.id": f"pretrain.campaign.{spec.name}",
        "prefect.resource.name": spec.name,
        "pretrain.workdir": str(spec.workdir_path),
        "pretrain.spec.campaign-hash": spec.spec_hash(),
    }


def _stage(spec: CampaignSpec, stage: str) -> dict[str, str]:
    return {
        "prefect.resource.id": f"pretrain.stage.{spec.name}.{stage}",
        "prefect.resource.role": "stage",
        "prefect.resource.name": stage,
    }


def emit_campaign_event(
    spec: CampaignSpec, event: str, payload: dict, stage: str | None = None, labels: dict[str, str] | None = None
) -> None:
    """Emit ``event`` about the campaign (its resource, with extra ``labels``), related to ``stage``."""
    emit_event(
        event=event,
        resource={**campaign_resource(spec), **(labels or {})},
        payload=payload,
        related=[_stage(spec, stage)] if stage else None,
    )


def _data_location(spec: CampaignSpec) -> str | None:
    """Where the campaign's data set is (None when it has none recorded: an event never fails for it)."""
    try:
        return campaign_data(spec).location
    except (DataError, LedgerError):
        return None


def checkpoint_verdict(spec: CampaignSpec, stage: str, path: str, record: dict) -> None:
    """``pretrain.checkpoint.good`` or ``.bad`` for a validated checkpoint (``record``: the verdict)."""
    good = record.get("verdict") == "good"
    final = record.get("step", -1) >= spec.stages[spec.stage_index(stage)].steps
    emit_campaign_event(
        spec,
        CHECKPOINT_GOOD if good else CHECKPOINT_BAD,
        {
            "stage": stage,
            "step": record.get("step"),
            "checkpoint": path,
            "verdict": record.get("verdict"),
            "final": final,
            "problems": record.get("problems", []),
            "data_dir": _data_location(spec),
        },
        stage,
        labels={FINAL_LABEL: str(final).lower()},
    )


def stage_relaunched(spec: CampaignSpec, stage: str, attempt: int, from_step: int | None) -> None:
    """A stage's job launched again (after a failed job, or when a stopped campaign resumes)."""
    emit_campaign_event(
        spec, STAGE_RESTARTED, {"stage": stage, "attempt": attempt, "in_job": False, "from_step": from_step}, stage
    )


def job_restarts(spec: CampaignSpec, stage: str, attempt: int, resumes: list[dict], incidents: list[dict]) -> int:
    """One event per in-job restart of the workers (elastic agent restarts) and per fast recovery
    that replaced lost workers (the others kept running) a finished job reported; returns how
    many restarts the job had (the ledger's ``restarts`` of the stage grow by it)."""
    for r in resumes:
        if r.get("restart_count", 0) > 0:
            emit_campaign_event(
                spec,
                STAGE_RESTARTED,
                {
                    "stage": stage,
                    "attempt": attempt,
                    "in_job": True,
                    "restart_count": r["restart_count"],
                    "from_step": r.get("step"),
                    "source": r.get("source"),
                    "recovery_path": "restart",
                },
                stage,
            )
    replaced = [i for i in incidents if i.get("recovery_path") in REPLACEMENT_PATHS]
    for i in replaced:
        where = {"where": where_hung(i)} if i.get("stacks") else {}  # a hung worker: where it was
        emit_campaign_event(
            spec,
            STAGE_RESTARTED,
            {
                "stage": stage,
                "attempt": attempt,
                "in_job": True,
                "recovery_path": i["recovery_path"],
                "cause": i.get("cause"),
                "action": i.get("action"),
                "recovery_s": i.get("recovery_s"),
                **where,
            },
            stage,
        )
    return max((r.get("restart_count", 0) for r in resumes), default=0) + len(replaced)


def stage_failed(spec: CampaignSpec, stage: str, step: int, attempts: int, cause: str | None, message: str) -> None:
    emit_campaign_event(
        spec,
        STAGE_FAILED,
        {"stage": stage, "step": step, "attempts": attempts, "cause": cause, "message": message},
        stage,
    )


def campaign_completed(spec: CampaignSpec, status: dict) -> None:
    emit_campaign_event(
        spec,
        CAMPAIGN_COMPLETED,
        {
            "workdir": status["workdir"],
            "invocations": status["invocations"],
            "stages": [
                {
                    "stage": s["name"],
                    "steps": s["steps_done"],
                    "good_checkpoint": s["good_checkpoint"],
                    "eval_loss": s["eval"]["val_loss"] if s["eval"] else None,
                }
                for s in status["stages"]
            ],
            # what an automation acting on the new model needs: its URI, or why there is none yet
            "registered_model": (status.get("registered_model") or {}).get("uri"),
            "registration_pending": status.get("registration_pending"),
        },
    )
