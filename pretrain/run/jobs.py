"""Turn a campaign spec into the job config a stage's workers read (``trainer.job.config``)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from pretrain.spec.campaign import CampaignSpec
from pretrain.state.guard import job_lease
from pretrain.state.locations import (
    checkpoint_location,
    client_options,
    data_client_options,
    data_options,
)
from trainer.checkpoint.store import CheckpointStore
from trainer.common.atomic import atomic_write_bytes
from trainer.data.cache import fetch_manifest
from trainer.job.config import (
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    FaultToleranceConfig,
    JobConfig,
    ModelConfig,
    StageConfig,
    TrackingConfig,
    drill_from_dict,
)


def _fields(section: type, *resolved: str) -> set[str]:
    """The fields of a job section the spec's section of the same name holds as they are (the
    same names on both sides); ``resolved``: those the orchestrator works out instead."""
    return {f.name for f in dataclasses.fields(section)} - set(resolved)


STAGE_FIELDS = _fields(StageConfig, "name", "index", "global_batch", "mixture", "init_from", "skip_samples")
CHECKPOINT_FIELDS = _fields(CheckpointConfig, "location", "s3_max_attempts")
FAULT_TOLERANCE_FIELDS = _fields(FaultToleranceConfig)
CLUSTER_FIELDS = _fields(ClusterConfig, "threads_per_worker")


def model_config(spec: CampaignSpec, vocab_size: int) -> ModelConfig:
    m = spec.model
    return ModelConfig(
        vocab_size=vocab_size,
        n_layer=m.n_layer,
        n_head=m.n_head,
        d_model=m.d_model,
        max_seq_len=m.max_seq_len,
        dropout=m.dropout,
    )


def checkpoint_store(spec: CampaignSpec, stage: str) -> CheckpointStore:
    return CheckpointStore.open(checkpoint_location(spec, stage), client_options(spec))


def threads_per_worker(spec: CampaignSpec) -> int:
    c = spec.cluster
    return c.threads_per_worker or max(1, (os.cpu_count() or 1) // (c.workers_per_node * c.nodes_max))


def build_job(spec: CampaignSpec, stage_index: int, attempt: int, init_from: str | None) -> JobConfig:
    """The job of the stage's ``attempt``-th launch, on the data set the ledger records (its
    vocabulary from that data set's summary, or its manifest for a summary that lacks it)."""
    from pretrain.data.campaign import campaign_data  # torch (the data manifest reader): only when a job is built

    data = campaign_data(spec)
    vocab = data.vocab_size or fetch_manifest(data.location, data_client_options(spec))[2]["vocab_size"]
    return job_config(spec, stage_index, attempt, init_from, vocab, data.location, data.fingerprint or "")


def job_config(
    spec: CampaignSpec,
    stage_index: int,
    attempt: int,
    init_from: str | None,
    vocab_size: int,
    data_location: str | None = None,
    data_fingerprint: str = "",
) -> JobConfig:
    """Every field of the job from the spec: the one place the trainer's settings come from.
    ``data_location``: the data set's directory or s3:// URL (None: ``<workdir>/data``)."""
    stage, ft, c, ckpt = spec.stages[stage_index], spec.fault_tolerance, spec.cluster, spec.checkpoint
    data_s3 = data_options(spec)
    return JobConfig(
        seed=spec.seed,
        attempt=attempt,
        job_dir=str(spec.layout.job_dir(stage.name, attempt)),
        model=model_config(spec, vocab_size),
        stage=StageConfig(
            name=stage.name,
            index=stage_index,
            **stage.model_dump(include=STAGE_FIELDS),
            global_batch=stage.micro_batch * stage.grad_accum * c.workers_per_node * c.nodes_max,
            mixture=dict(stage.mixture),
            init_from=init_from,
            skip_samples=[(w.start, w.end) for w in spec.skip_samples if w.stage == stage.name],
        ),
        data=DataConfig(
            uri=data_location or str(spec.layout.data_dir),
            fingerprint=data_fingerprint,
            cache_dir=str(spec.layout.data_cache),
            s3_endpoint_url=data_s3.get("endpoint_url"),
            s3_region=data_s3.get("region"),
        ),
        checkpoint=CheckpointConfig(
            location=checkpoint_location(spec, stage.name), **ckpt.model_dump(include=CHECKPOINT_FIELDS)
        ),
        fault_tolerance=FaultToleranceConfig(**ft.model_dump(include=FAULT_TOLERANCE_FIELDS)),
        cluster=ClusterConfig(
            **c.model_dump(include=CLUSTER_FIELDS),
            threads_per_worker=threads_per_worker(spec),
        ),
        tracking=TrackingConfig(log_every=spec.tracking.log_every),
        lease=job_lease(spec),
        chaos=[
            drill_from_dict(d.model_dump(exclude={"stage"}))
            for d in spec.chaos
            if (d.stage or spec.stages[0].name) == stage.name
        ],
    )


def write_job(job: JobConfig) -> Path:
    path = job.layout.config
    atomic_write_bytes(path, job.to_json().encode())
    return path
