"""Checkpoint tasks: find where to resume, validate, record the verdict."""

from __future__ import annotations

import time

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pretrain.jobs import checkpoint_store, model_config, storage_options
from pretrain.layout import CampaignLayout
from pretrain.spec import CampaignSpec
from trainer.checkpoint import CheckpointStore
from trainer.data import read_manifest
from trainer.evaluate import Verdict, validate


@task(name="find-resume-point", cache_policy=NO_CACHE)
def find_resume_point(spec: CampaignSpec, stage_index: int) -> dict | None:
    """The newest complete checkpoint of the stage (None: the stage starts fresh)."""
    ref = checkpoint_store(spec, spec.stages[stage_index].name).latest_complete()
    return None if ref is None else ref.to_dict()


@task(name="validate-checkpoint", cache_policy=NO_CACHE)
def check_checkpoint(spec: CampaignSpec, path: str) -> dict:
    """Validate the checkpoint and write its verdict next to it (and the stage's good pointer)."""
    logger = get_run_logger()
    vocab = read_manifest(CampaignLayout(spec.workdir_path).data_dir)["vocab_size"]
    verdict: Verdict = validate(path, model_config(spec, vocab), storage_options(spec))
    record = {**verdict.to_dict(), "verdict": "good" if verdict.ok else "bad", "time": time.time()}
    store, step = CheckpointStore.of_step(path, storage_options(spec))
    store.set_verdict(step, record)
    if verdict.ok:
        logger.info("checkpoint %s is good (step %s)", path, verdict.step)
    else:
        logger.error("checkpoint %s is bad: %s", path, "; ".join(verdict.problems))
    return record
