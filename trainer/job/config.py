"""Job configuration handed from the orchestrator to every worker as one JSON file.

Plain dataclasses (no pydantic, no prefect) so pods need nothing but torch and numpy. The
orchestrator builds it from the campaign spec (``pretrain.run.jobs.build_job``), which is the one
place defaults live: no field here has a default of its own.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


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
class OptimConfig:
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


# ---- chaos drills (trainer.resilience.chaos), typed per kind as in the spec (pretrain.spec.sections) ----------
@dataclass(frozen=True)
class Drill:
    kind: str  # which fault
    step: int  # the stage step it fires at (slow_worker: from)


@dataclass(frozen=True)
class WorkerDrill(Drill):
    """kill_worker, hang_worker, nan_loss."""

    rank: int  # the worker's global rank


@dataclass(frozen=True)
class LossSpike(WorkerDrill):
    factor: float  # the loss of that step is multiplied by this


@dataclass(frozen=True)
class SlowWorker(WorkerDrill):
    delay_s: float  # extra seconds per step (and per matmul of its node check)


@dataclass(frozen=True)
class NodeDrill(Drill):
    """kill_saver, kill_node, freeze_node (fired by the node's agent)."""

    node: int  # the node's index


@dataclass(frozen=True)
class CorruptCheckpoint(Drill):
    """One byte of the model state committed at ``step`` flipped (by the saver)."""


DRILLS: dict[str, type[Drill]] = {
    "kill_worker": WorkerDrill,
    "hang_worker": WorkerDrill,
    "nan_loss": WorkerDrill,
    "loss_spike": LossSpike,
    "slow_worker": SlowWorker,
    "kill_saver": NodeDrill,
    "kill_node": NodeDrill,
    "freeze_node": NodeDrill,
    "corrupt_checkpoint": CorruptCheckpoint,
}


def drill_from_dict(d: dict) -> Drill:
    """The typed drill of a ``job.json`` entry (its kind's fields, nothing else)."""
    return DRILLS[d["kind"]](**d)


@dataclass(frozen=True)
class JobConfig:
    stage: str  # stage name
    stage_index: int  # position of the stage in the campaign (seeds its data order)
    seed: int  # campaign seed
    data_dir: str  # the data set: a directory with manifest.json and token shards, or its s3:// URL
    data_fingerprint: str  # the data set the job trains on ("" : not recorded); checkpoints record it
    data_cache_dir: str  # node-local directory a data set on S3 is fetched into (trainer.data.cache)
    data_options: dict  # S3 options for data_dir (endpoint_url, region); never secrets
    ckpt_dir: str  # this stage's checkpoint directory
    job_dir: str  # this launch's directory: metrics.jsonl, events.jsonl, logs
    model: ModelConfig
    optim: OptimConfig
    init_from: str | None  # checkpoint directory to start from when the stage has none
    init_optimizer: bool  # also take optimizer state from init_from
    ckpt_interval: int  # steps between checkpoints persisted to storage
    memory_interval: int  # steps between shared-memory snapshots; 0 = write checkpoints directly
    shm_dir: str  # where the node's snapshot slots live
    shm_fallback: bool  # too little shared memory: persist directly instead of failing
    storage_options: dict  # S3 options for ckpt_dir (endpoint_url, region); never secrets
    hang_timeouts: dict  # phase → seconds without a heartbeat before a worker counts as hung
    hang_adaptive: (
        dict  # factor, floor_s, warmup: the step timeout adapted to observed steps (heartbeat.AdaptiveTimeout)
    )
    spike: dict  # window, zscore, min_steps of the loss-spike detector (zscore 0: off)
    max_rollbacks: int  # loss anomalies tolerated in the stage before it fails
    rollback_in_process: bool  # roll anomalies back inside the running workers (else: restart them)
    skip: list  # [start, end) sample windows never trained on
    node_check_threshold: float  # after a restart, a node slower than this × the median node is excluded
    nodes_min: int  # fewest nodes the job may shrink to
    mixture: dict  # data group → weight for this stage; empty: the whole split, one order
    chaos: list[Drill]  # chaos drills for this stage (trainer.resilience.chaos)
    ckpt_keep: int  # committed checkpoints kept
    attempt: int  # the stage's launch number (its job directory names it); fences commits to the newest job
    saver_max_failures: int  # checkpoint saver failures in a row (none persisting a step) before the job fails
    saver_backoff_s: float  # first wait before restarting a failed saver; doubles with each failure in a row
    log_every: int  # steps between metric lines
    backend: str  # auto | gloo | nccl
    parallelism: str  # ddp (replicated model, rank 0 checkpoints it) | fsdp (FSDP2: every rank its shard)
    threads_per_worker: int  # torch intra-op threads; 0 = leave as launched
    lease: dict  # the campaign lease the job runs under: {"location", "key", "generation"} (trainer.checkpoint.fence.LeaseFence); {}: none (local state, the flock)
    # fast recovery under the single-node agent (trainer.agent.single_node); defaults for a job file of the release before
    spares_per_node: int = 1  # warm spare workers kept per node (0: a lost worker is replaced by a cold start)
    fast_recovery_timeout_s: float = (
        30.0  # a lost worker not replaced (all ranks restored) by then: full restart; 0: always
    )
    saver_outage_s: float = (
        600.0  # checkpoint storage unreachable this long (the saver retried meanwhile): the job fails
    )

    def checkpoints(self):
        """This stage's checkpoint store (local directory or S3 prefix)."""
        from trainer.checkpoint.store import CheckpointStore

        return CheckpointStore.open(self.ckpt_dir, self.storage_options)

    def checkpoint_at(self, location: str):
        """The store and step of a checkpoint location (e.g. ``init_from``)."""
        from trainer.checkpoint.store import CheckpointStore

        return CheckpointStore.of_step(location, self.storage_options)

    def checkpoint_meta(self) -> dict:
        """What every checkpoint's manifest records so it can be evaluated and exported with no
        spec (``pretrain eval`` / ``pretrain export``): the model, the data set it was trained
        on (where: its tokenizer and validation split; which: its fingerprint) and the stage's
        sequence length."""
        return {
            "stage": self.stage,
            "model": asdict(self.model),
            "data_dir": self.data_dir,
            "data_fingerprint": self.data_fingerprint,
            "data_options": self.data_options,
            "seq_len": self.optim.seq_len,
        }

    def local_data(self, splits: tuple[str, ...] = ("train",), on_progress=None) -> Path:
        """The local directory of this job's data set (its ``splits`` fetched into the node cache
        when it is on S3; the ranks of one launch verify the cache once)."""
        from trainer.data.cache import local_data_dir

        return local_data_dir(
            self.data_dir,
            self.data_cache_dir,
            self.data_options,
            splits=splits,
            fingerprint=self.data_fingerprint or None,
            session=self.job_dir,
            on_progress=on_progress,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> JobConfig:
        d = dict(d)
        d["model"] = ModelConfig(**d["model"])
        d["optim"] = OptimConfig(**d["optim"])
        d["chaos"] = [drill_from_dict(x) for x in d["chaos"]]
        return cls(**d)

    @classmethod
    def load(cls, path: str | Path) -> JobConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


# The environment of every node agent of a job with standby nodes (local or Kubernetes): torch's
# agents share their rendezvous store with the workers, and a node that was in the first round
# never publishes that store's address again, so a standby joining a later round waited for it
# forever. Unshared, rank 0 publishes a fresh store every round.
STANDBY_NODE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
