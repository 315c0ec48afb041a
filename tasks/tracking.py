"""MLflow tasks: open (or reattach to) the campaign's runs, close them truthfully."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from pretrain.layout import CampaignLayout
from pretrain.ledger import Ledger
from pretrain.spec import CampaignSpec
from pretrain.tracking import Tracker


def tracker_for(spec: CampaignSpec) -> Tracker:
    return Tracker(spec.tracking_uri, spec.tracking.experiment, CampaignLayout(spec.workdir_path).mlflow_artifacts)


@task(name="open-campaign-run", cache_policy=NO_CACHE)
def open_campaign_run(spec: CampaignSpec, ledger: Ledger) -> str:
    params = spec.model_dump(mode="json", exclude={"stages"})
    params["stages"] = ",".join(f"{s.name}:{s.steps}" for s in spec.stages)
    run_id = tracker_for(spec).campaign_run(ledger.data["campaign_id"], spec.name, spec.spec_hash(), params)
    ledger.mutate(lambda d: d["mlflow"].update(parent_run_id=run_id))
    return run_id


@task(name="open-stage-run", cache_policy=NO_CACHE)
def open_stage_run(spec: CampaignSpec, ledger: Ledger, stage_index: int) -> str:
    stage = spec.stages[stage_index]
    run_id = tracker_for(spec).stage_run(ledger.data["campaign_id"], ledger.data["mlflow"]["parent_run_id"],
                                         spec.name, stage.name, stage.model_dump(mode="json"))
    ledger.update_stage(stage.name, mlflow_run_id=run_id)
    return run_id


@task(name="finish-run", cache_policy=NO_CACHE)
def finish_run(spec: CampaignSpec, run_id: str, status: str) -> None:
    tracker_for(spec).finish(run_id, status)
