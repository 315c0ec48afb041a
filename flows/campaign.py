"""Flow: a whole pre-training campaign.

prepare_data → provision_cluster → for each stage: train_stage → validate_checkpoint → evaluate.

Idempotent: everything it needs to continue is in the workdir (data manifest, checkpoints,
ledger), so running it again after any crash — of a worker, of the job, of this process —
skips what is done and resumes the current stage from its newest complete checkpoint.
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.evaluate import evaluate
from flows.prepare_data import prepare_data
from flows.provision_cluster import provision_cluster
from flows.train_stage import train_stage
from flows.validate_checkpoint import validate_checkpoint
from pretrain.ledger import Ledger
from pretrain.spec import CampaignSpec, resolve_spec
from pretrain.status import campaign_status
from tasks.registry import register_final_model
from tasks.tracking import finish_run, open_campaign_run


@flow(name="pretrain-campaign")
def pretrain_campaign(spec: CampaignSpec | None = None, spec_path: str | None = None,
                      workdir: str | None = None) -> dict:
    """Run (or resume) a campaign. Give ``spec`` inline or ``spec_path`` (a YAML file or
    ``builtin:tiny``); ``workdir`` overrides where the campaign keeps its state."""
    logger = get_run_logger()
    spec = resolve_spec(spec, spec_path, workdir)
    spec.workdir_path.mkdir(parents=True, exist_ok=True)
    ledger = Ledger.open(spec)
    ledger.mutate(lambda d: d.update(status="running", invocations=d["invocations"] + 1))
    logger.info("campaign %s in %s (spec %s)", spec.name, spec.workdir_path, spec.spec_hash())
    parent_run_id = open_campaign_run(spec, ledger)
    current = None
    try:
        prepare_data(spec)
        provision_cluster(spec)
        init_from = None
        for i, stage in enumerate(spec.stages):
            current = stage.name
            done = ledger.reload()["stages"][stage.name]
            if done["status"] == "completed":
                logger.info("stage %s already completed at step %s; skipping", stage.name, done["final_checkpoint"]["step"])
                init_from = done["good_checkpoint"]["path"]
                continue
            final = train_stage(spec, i, init_from)
            validate_checkpoint(spec, stage.name, final["path"])
            evaluate(spec, stage.name, final["path"], final["step"])
            finish_run(spec, ledger.reload()["stages"][stage.name]["mlflow_run_id"], "FINISHED")
            ledger.update_stage(stage.name, status="completed")
            init_from = final["path"]
        current = None  # every stage is done (a failure from here on is the campaign's, not a stage's)
        register_final_model(spec)
    except BaseException:
        ledger.set(status="failed")
        stage_run_id = ledger.stage(current)["mlflow_run_id"] if current else None
        for run_id in (stage_run_id, parent_run_id):
            if run_id:
                finish_run(spec, run_id, "FAILED")
        raise
    ledger.set(status="completed")
    finish_run(spec, parent_run_id, "FINISHED")
    return campaign_status(spec.workdir_path)
