"""Job configuration handed from the orchestrator to every worker as one JSON file.

Plain dataclasses (no pydantic, no prefect) so pods need nothing but torch and numpy. The
orchestrator builds it from the campaign spec (``pretrain.run.jobs.build_job``), which is the one
place defaults live: no field here has a default of its own.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from trainer.job.layout import JobLayout
from trainer.job.upgrade import upgraded


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int  # tokens in the vocabulary (from the tokenizer)
    n_layer: int  # transformer blocks
    n_head: int  # attention heads per block
    d_model: int  # hidden size
    max_seq_len: int  # rows of the learned position table
    dropout: float  # dropout probability

    def num_params(self) -> int:
        """Parameters of ``trainer.model.GPT`` (embeddings tied), without building it."""
        d, per_layer = self.d_model, 12 * self.d_model**2 + 13 * self.d_model
        return self.vocab_size * d + self.max_seq_len * d + self.n_layer * per_layer + 2 * d


@dataclass(frozen=True)
class StageConfig:
    """The stage this job trains: ``stages[index]`` of the spec (``StageSpec``), resolved."""

    name: str  # stage name
    index: int  # position of the stage in the campaign (seeds its data order)
    steps: int  # optimizer steps in the stage
    lr: float  # peak learning rate
    min_lr: float  # final learning rate of the cosine decay
    warmup_steps: int  # linear warm-up steps
    weight_decay: float  # AdamW weight decay (matrices only)
    grad_clip: float  # global grad-norm clip
    micro_batch: int  # sequences per worker per micro-step
    grad_accum: int  # micro-steps per optimizer step at full size (nodes_max)
    seq_len: int  # tokens per sequence
    global_batch: int  # sequences per optimizer step, fixed whatever the world size; 0 = micro × accum × world
    mixture: dict[str, float]  # data group → weight for this stage; empty: the whole split, one order
    carry_optimizer: bool  # also take optimizer state from init_from
    init_from: str | None  # checkpoint directory to start from when the stage has none (resolved)
    skip_samples: list[tuple[int, int]]  # [start, end) sample windows of this stage never trained on

    def accum_for(self, world: int) -> int:
        """Micro-steps per optimizer step that keep ``global_batch`` fixed at this world size."""
        if not self.global_batch:
            return self.grad_accum
        per_micro = self.micro_batch * world
        if self.global_batch % per_micro:
            raise ValueError(
                f"global batch {self.global_batch} is not a multiple of micro_batch × world "
                f"({self.micro_batch} × {world}): choose sizes that divide it for every world size in "
                f"nodes_min..nodes_max"
            )
        return self.global_batch // per_micro


def s3_options(endpoint_url: str | None = None, region: str | None = None) -> dict[str, str]:
    """Keyword arguments of an S3 client for these settings (credentials come from the environment)."""
    return {k: v for k, v in (("endpoint_url", endpoint_url), ("region", region)) if v}


@dataclass(frozen=True)
class DataConfig:
    """The data set the job trains on (the spec's ``data`` section, resolved)."""

    uri: str  # a directory with manifest.json and token shards, or its s3:// URL
    fingerprint: str  # which data set ("": not recorded); checkpoints record it
    cache_dir: str  # node-local directory a data set on S3 is fetched into (trainer.data.cache)
    s3_endpoint_url: str | None  # S3 endpoint of ``uri`` (the data section's, else the checkpoints')
    s3_region: str | None  # S3 region of ``uri``

    @property
    def options(self) -> dict[str, str]:
        """Storage options for ``uri`` (never secrets)."""
        return s3_options(self.s3_endpoint_url, self.s3_region)


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often the stage checkpoints (the spec's ``checkpoint`` section)."""

    location: str  # this stage's checkpoint directory: ``<checkpoint.uri>/<stage>``
    interval: int  # steps between checkpoints persisted to storage
    memory_interval: int  # steps between shared-memory snapshots; 0 = write checkpoints directly
    keep: int  # committed checkpoints kept
    shm_dir: str  # where the node's snapshot slots live
    shm_fallback: bool  # too little shared memory: persist directly instead of failing
    s3_endpoint_url: str | None  # S3 endpoint of ``location``
    s3_region: str | None  # S3 region of ``location``
    s3_max_attempts: int | None = None  # tries of each S3 request; None: the client's own default. Not in the spec

    @property
    def options(self) -> dict:
        """Storage options for ``location`` (never secrets)."""
        options = s3_options(self.s3_endpoint_url, self.s3_region)
        return options if self.s3_max_attempts is None else {**options, "max_attempts": self.s3_max_attempts}


@dataclass(frozen=True)
class FaultToleranceConfig:
    """How the job detects and survives faults (the spec's ``fault_tolerance`` section)."""

    startup_timeout_s: float  # seconds without a heartbeat while a worker starts before it counts as hung
    step_timeout_s: float  # … during a step
    checkpoint_timeout_s: float  # … while it saves
    hang_timeout_factor: float  # the step timeout adapts to factor × p99 of observed steps; 0: fixed
    hang_timeout_floor_s: float  # the adapted timeout never drops below this
    hang_warmup_steps: int  # steps observed before the timeout adapts
    spike_zscore: float  # loss-spike detector threshold (0: off)
    spike_window: int  # steps in its trailing window
    spike_min_steps: int  # steps it observes before it judges
    max_rollbacks: int  # loss anomalies tolerated in the stage before it fails
    rollback_in_process: bool  # roll anomalies back inside the running workers (else: restart them)
    node_check_threshold: float  # after a restart, a node slower than this × the median node is excluded
    saver_max_failures: int  # checkpoint saver failures in a row (none persisting a step) before the job fails
    saver_backoff_s: float  # first wait before restarting a failed saver; doubles with each failure in a row
    storage_outage_s: float  # checkpoint storage unreachable this long (the saver retried meanwhile): the job fails
    fast_recovery_timeout_s: float  # a lost worker not replaced by then: full restart; 0: always

    @property
    def phase_timeouts(self) -> dict[str, float]:
        """Phase → seconds without a heartbeat before a worker counts as hung."""
        return {"startup": self.startup_timeout_s, "step": self.step_timeout_s, "checkpoint": self.checkpoint_timeout_s}


@dataclass(frozen=True)
class ClusterConfig:
    """How the job's processes run (the spec's ``cluster`` section, resolved)."""

    nodes_min: int  # fewest nodes the job may shrink to
    spares_per_node: int  # warm spare workers kept per node (0: a lost worker is replaced by a cold start)
    backend: str  # auto | gloo | nccl
    parallelism: str  # ddp (replicated model, rank 0 checkpoints it) | fsdp (FSDP2: every rank its shard)
    threads_per_worker: int  # torch intra-op threads; 0 = leave as launched


@dataclass(frozen=True)
class TrackingConfig:
    """What the job records for tracking (the spec's ``tracking`` section)."""

    log_every: int  # steps between metric lines


@dataclass(frozen=True)
class LeaseConfig:
    """The campaign lease the job runs under (trainer.checkpoint.fence.LeaseFence)."""

    location: str  # where the campaign's state lives
    key: str  # the lease record's key there
    generation: int  # the generation this job was launched under; a newer one fences its commits


# ---- chaos drills (trainer.resilience.chaos), typed per kind as in the spec (pretrain.spec.drills) ----------
@dataclass(frozen=True)
class Drill:
    kind: str  # which fault
    step: int  # the stage step it fires at (slow_worker: from)


@dataclass(frozen=True)
class WorkerDrill(Drill):
    """kill_worker, hang_worker, nan_loss."""

    rank: int  # the worker's global rank


@dataclass(frozen=True)
class LossSpikeDrill(WorkerDrill):
    factor: float  # the loss of that step is multiplied by this


@dataclass(frozen=True)
class SlowWorkerDrill(WorkerDrill):
    delay_s: float  # extra seconds per step (and per matmul of its node check)


@dataclass(frozen=True)
class NodeDrill(Drill):
    """kill_saver, kill_node, freeze_node (fired by the node's agent)."""

    node: int  # the node's index


@dataclass(frozen=True)
class CorruptCheckpointDrill(Drill):
    """One byte of the model state committed at ``step`` flipped (by the saver)."""


DRILLS: dict[str, type[Drill]] = {
    "kill_worker": WorkerDrill,
    "hang_worker": WorkerDrill,
    "nan_loss": WorkerDrill,
    "loss_spike": LossSpikeDrill,
    "slow_worker": SlowWorkerDrill,
    "kill_saver": NodeDrill,
    "kill_node": NodeDrill,
    "freeze_node": NodeDrill,
    "corrupt_checkpoint": CorruptCheckpointDrill,
}


def drill_from_dict(d: dict) -> Drill:
    """The typed drill of a ``job.json`` entry (its kind's fields, nothing else)."""
    return DRILLS[d["kind"]](**d)


_SECTIONS = {
    "model": ModelConfig,
    "stage": StageConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "fault_tolerance": FaultToleranceConfig,
    "cluster": ClusterConfig,
    "tracking": TrackingConfig,
}


@dataclass(frozen=True)
class JobConfig:
    """One launch of one stage. Its sections mirror the spec's and keep the spec's names."""

    seed: int  # campaign seed
    attempt: int  # the stage's launch number (its job directory names it); fences commits to the newest job
    job_dir: str  # this launch's directory: metrics.jsonl, events.jsonl, logs (``layout``)
    model: ModelConfig
    stage: StageConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    fault_tolerance: FaultToleranceConfig
    cluster: ClusterConfig
    tracking: TrackingConfig
    lease: LeaseConfig | None  # None: no lease (local state, the flock)
    chaos: list[Drill]  # chaos drills for this stage (trainer.resilience.chaos)

    @property
    def layout(self) -> JobLayout:
        """Where each of this job's files is (its directory and its stage's)."""
        return JobLayout.of(self.job_dir)

    def checkpoint_meta(self) -> dict:
        """What every checkpoint's manifest records so it can be evaluated and exported with no
        spec (``pretrain eval`` / ``pretrain export``): the model, the data set it was trained
        on (where: its tokenizer and validation split; which: its fingerprint) and the stage's
        sequence length."""
        return {
            "stage": self.stage.name,
            "model": asdict(self.model),
            "data_dir": self.data.uri,
            "data_fingerprint": self.data.fingerprint,
            "data_options": self.data.options,
            "seq_len": self.stage.seq_len,
        }

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> JobConfig:
        d = dict(d) if "stage" in d and isinstance(d["stage"], dict) else upgraded(d)
        for name, section in _SECTIONS.items():
            d[name] = section(**d[name])
        d["stage"] = replace(d["stage"], skip_samples=[(int(a), int(b)) for a, b in d["stage"].skip_samples])
        d["lease"] = LeaseConfig(**d["lease"]) if d.get("lease") else None
        d["chaos"] = [drill_from_dict(x) for x in d["chaos"]]
        return cls(**d)

    def amended(self, **changes) -> JobConfig:
        """This job with some fields changed: a section's as a dict (``checkpoint={"interval": 10}``),
        a top-level field as its value."""
        for name, value in changes.items():
            if name in _SECTIONS and isinstance(value, dict):
                changes[name] = replace(getattr(self, name), **value)
        return replace(self, **changes)

    @classmethod
    def load(cls, path: str | Path) -> JobConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


# The environment of every node agent of a job with standby nodes (local or Kubernetes): torch's
# agents share their rendezvous store with the workers, and a node that was in the first round
# never publishes that store's address again, so a standby joining a later round waited for it
# forever. Unshared, rank 0 publishes a fresh store every round.
STANDBY_NODE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
