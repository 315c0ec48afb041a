"""Turn a campaign spec into the job config a stage's workers read (``trainer.job.config``)."""

from __future__ import annotations

import os
from pathlib import Path

from pretrain.spec.campaign import CampaignSpec
from pretrain.state.guard import job_lease
from pretrain.state.layout import CampaignLayout
from pretrain.state.locations import (
    checkpoint_location,
    client_options,
    data_client_options,
    data_options,
    storage_options,
)
from trainer.checkpoint.store import CheckpointStore
from trainer.common.atomic import atomic_write_bytes
from trainer.data.cache import fetch_manifest
from trainer.job.config import JobConfig, ModelConfig, OptimConfig, drill_from_dict


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
    layout = CampaignLayout(spec.workdir_path)
    stage = spec.stages[stage_index]
    c, ft = spec.cluster, spec.fault_tolerance
    optim = OptimConfig(
        steps=stage.steps,
        lr=stage.lr,
        min_lr=stage.min_lr,
        warmup_steps=stage.warmup_steps,
        weight_decay=stage.weight_decay,
        grad_clip=stage.grad_clip,
        micro_batch=stage.micro_batch,
        grad_accum=stage.grad_accum,
        seq_len=stage.seq_len,
        global_batch=stage.micro_batch * stage.grad_accum * c.workers_per_node * c.nodes_max,
    )
    return JobConfig(
        stage=stage.name,
        stage_index=stage_index,
        seed=spec.seed,
        data_dir=data_location or str(layout.data_dir),
        data_fingerprint=data_fingerprint,
        data_cache_dir=str(layout.data_cache),
        data_options=data_options(spec),
        ckpt_dir=checkpoint_location(spec, stage.name),
        job_dir=str(layout.job_dir(stage.name, attempt)),
        storage_options=storage_options(spec),
        model=model_config(spec, vocab_size),
        optim=optim,
        init_from=init_from,
        init_optimizer=stage.carry_optimizer,
        ckpt_interval=spec.checkpoint.interval,
        ckpt_keep=spec.checkpoint.keep,
        memory_interval=spec.checkpoint.memory_interval,
        shm_dir=spec.checkpoint.shm_dir,
        shm_fallback=spec.checkpoint.shm_fallback,
        log_every=spec.tracking.log_every,
        backend=spec.cluster.backend,
        parallelism=spec.cluster.parallelism,
        threads_per_worker=threads_per_worker(spec),
        lease=job_lease(spec),
        hang_timeouts={
            "startup": ft.startup_timeout_s,
            "step": ft.step_timeout_s,
            "checkpoint": ft.checkpoint_timeout_s,
        },
        hang_adaptive={
            "factor": ft.hang_timeout_factor,
            "floor_s": ft.hang_timeout_floor_s,
            "warmup": ft.hang_warmup_steps,
        },
        spike={"window": ft.spike_window, "zscore": ft.spike_zscore, "min_steps": ft.spike_min_steps},
        max_rollbacks=ft.max_rollbacks,
        rollback_in_process=ft.rollback_in_process,
        attempt=attempt,
        saver_max_failures=ft.saver_max_failures,
        saver_backoff_s=ft.saver_backoff_s,
        saver_outage_s=ft.storage_outage_s,
        spares_per_node=c.spares_per_node,
        fast_recovery_timeout_s=ft.fast_recovery_timeout_s,
        skip=[[w.start, w.end] for w in spec.skip_samples if w.stage == stage.name],
        mixture=dict(stage.mixture),
        node_check_threshold=ft.node_check_threshold,
        nodes_min=c.nodes_min,
        chaos=[
            drill_from_dict(d.model_dump(exclude={"stage"}))
            for d in spec.chaos
            if (d.stage or spec.stages[0].name) == stage.name
        ],
    )


def write_job(job: JobConfig) -> Path:
    path = Path(job.job_dir) / "job.json"
    atomic_write_bytes(path, job.to_json().encode())
    return path
