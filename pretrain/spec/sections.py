"""The sections of a campaign spec (data, model, cluster, stages, checkpoints, tracking, …), each
a pydantic model with a documented default for every field; :class:`pretrain.spec.campaign.CampaignSpec`
puts them together and checks the rules that span sections.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from pretrain.redact import url_credentials
from pretrain.spec.base import Section
from pretrain.spec.kube import KubernetesSpec

MAX_STEPS = 99_999_999  # step directories are named with 8 digits (step_00000040)
S3_CREDENTIALS_GO = (
    "S3 credentials come from the AWS environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
    "an instance or IRSA role) or from an s3-campaign-storage block's credentials (stored as secrets)"
)
MLFLOW_CREDENTIALS_GO = (
    "MLflow credentials come from MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD or "
    "MLFLOW_TRACKING_TOKEN in the environment, or from an mlflow-tracking block's token"
)


def no_credentials_in_url(url: str | None, where: str) -> str | None:
    """``url`` unchanged, or a ValueError saying that credentials do not belong in it and ``where`` they go."""
    found = url_credentials(url) if url else None
    if found:
        raise ValueError(
            f"must not contain credentials ({found}): {where}; the URI itself is recorded in the "
            "ledger, MLflow and logs"
        )
    return url


class ModelSpec(Section):
    n_layer: int = Field(4, ge=1, description="Transformer blocks.")
    n_head: int = Field(4, ge=1, description="Attention heads per block.")
    d_model: int = Field(128, ge=8, description="Hidden size; must be divisible by n_head.")
    max_seq_len: int = Field(
        256, ge=8, description="Longest sequence the position table supports; every stage's seq_len must fit."
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability (0 keeps runs bitwise reproducible).")

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSpec:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        return self


class ClusterSpec(Section):
    kind: Literal["local", "kubernetes"] = Field(
        "local",
        description="Where workers run: 'local' processes, or 'kubernetes' (one pod per node, settings in "
        "`kubernetes`; `pretrain cluster render` shows the manifests; the flow reaches the API through KUBECONFIG or "
        "its pod's service account).",
    )
    workers_per_node: int = Field(
        2, ge=1, description="Training processes per node (one per accelerator; on CPU one per core is sensible)."
    )
    nodes_min: int = Field(1, ge=1, description="Fewest nodes the job may run with (elastic lower bound).")
    nodes_max: int = Field(1, ge=1, description="Most nodes the job starts with (elastic upper bound).")
    spare_nodes: int = Field(
        0,
        ge=0,
        description="Standby nodes of a job of several nodes (on Kubernetes: standby pods of the Job, indices "
        "nodes_max and up): their agents start once training is under way and wait in the rendezvous, torch imported; "
        "when a node is lost one takes its place at once, so the world keeps its size and global batch (no shrink, no "
        "scale-up later). The cluster has nodes_max + spare_nodes nodes; the node check covers them all.",
    )
    node_timeout_s: int = Field(
        3,
        ge=2,
        le=60,
        description="A node of a job of several nodes whose agent sent no keep-alive (one a second) for "
        "this long counts as lost and leaves the rendezvous; the other nodes wait that long before going on without it "
        "(or with a spare node). Lower is faster recovery; too low drops a node that is only slow (an agent starved of "
        "CPU for about a second at 2; with spare_nodes a standby then takes its place: a restart of the job).",
    )
    max_restarts: int = Field(
        2, ge=0, description="In-job restarts by the elastic agent before the job counts as failed."
    )
    spares_per_node: int = Field(
        1,
        ge=0,
        description="Warm spare workers per node: started once training is under way, with torch imported "
        "and the model built; when a worker dies the others keep running (on every node) and a spare of its node takes "
        "its rank (docs/recovery.md). On a job of several nodes a full restart or a new rendezvous round starts the "
        "node's spares anew. 0: the lost worker is replaced by a cold start, the others still kept.",
    )
    rejoin_after_s: float = Field(
        60.0,
        ge=0,
        description="A node lost during a job is health-checked again after this many seconds; if it passes, "
        "the job is stopped (the savers persist the newest snapshot) and relaunched on all nodes — the cluster scales "
        "back up with the same global batch and exact data position. 0: keep the smaller world until the job ends.",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Collective backend: 'auto' picks NCCL on GPU, gloo on CPU."
    )
    parallelism: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="Data parallelism: 'ddp' replicates model and optimizer on every worker (rank 0 checkpoints "
        "them); 'fsdp' shards them across the workers with FSDP2 (per block + root), and every worker checkpoints its "
        "own shard. Checkpoints of either kind can start or resume a stage of the other (docs/fault-tolerance.md).",
    )
    threads_per_worker: int = Field(
        0, ge=0, description="torch threads per worker; 0 divides the machine's cores among workers."
    )
    kubernetes: KubernetesSpec | None = Field(
        None,
        description="Pods of a 'kubernetes' cluster: namespace, image, resources, scheduling, secrets by reference.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> ClusterSpec:
        if self.nodes_min > self.nodes_max:
            raise ValueError(f"nodes_min ({self.nodes_min}) must not exceed nodes_max ({self.nodes_max})")
        if self.spare_nodes and self.nodes_max < 2:
            raise ValueError(
                "spare_nodes stand by for a job of several nodes: set nodes_max to 2 or more (a job of "
                "one node recovers a lost worker with spares_per_node)"
            )
        return self

    @property
    def node_count(self) -> int:
        """Nodes of the cluster: the job's (``nodes_max``) and its standby nodes."""
        return self.nodes_max + self.spare_nodes

    def nodes_in_use(self, excluded: int = 0) -> int:
        """Nodes a job trains on when ``excluded`` nodes failed the node check (standby nodes fill in first)."""
        return min(self.nodes_max, self.node_count - excluded)

    @model_validator(mode="after")
    def _kind_settings(self) -> ClusterSpec:
        if self.kind == "kubernetes" and self.kubernetes is None:
            raise ValueError("kind 'kubernetes' needs a `kubernetes` section (at least `image`)")
        if self.kind != "kubernetes" and self.kubernetes is not None:
            raise ValueError(f"the `kubernetes` section only applies to kind 'kubernetes' (kind is {self.kind!r})")
        return self


class StageSpec(Section):
    name: str = Field(
        ...,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="Stage name (letters, digits, '-', '_'); used in paths and MLflow.",
    )
    steps: int = Field(
        ...,
        gt=0,
        le=MAX_STEPS,
        description="Optimizer steps in this stage (below 10^8: step directories have 8 digits).",
    )
    lr: float = Field(3e-3, gt=0, description="Peak learning rate.")
    min_lr: float = Field(3e-4, ge=0, description="Learning rate at the end of the cosine decay.")
    warmup_steps: int = Field(10, ge=0, description="Linear warm-up steps before cosine decay.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the global gradient norm to this value.")
    micro_batch: int = Field(8, gt=0, description="Sequences per worker per forward/backward.")
    grad_accum: int = Field(1, gt=0, description="Micro-batches accumulated per optimizer step.")
    seq_len: int = Field(128, ge=8, description="Tokens per training sequence.")
    mixture: dict[str, float] = Field(
        default_factory=dict,
        description="Data group → weight (any positive scale): the stage draws its samples from "
        "the groups in these proportions, exactly and resumably. Empty: the whole training split in one order.",
    )
    carry_optimizer: bool = Field(
        True,
        description="Start from the previous stage's optimizer state (AdamW moments); false resets it. The model "
        "weights always carry over.",
    )
    init_from: str | None = Field(
        None,
        description="Start this stage from this checkpoint (…/step_XXXXXXXX, a local directory or s3:// URL; "
        "another campaign's, e.g. to continue on a changed data set) instead of the previous stage's final one "
        "(the first stage: from scratch). Only until the stage has checkpoints of its own.",
    )

    @field_validator("init_from")
    @classmethod
    def _no_credentials(cls, url: str | None) -> str | None:
        return no_credentials_in_url(url, S3_CREDENTIALS_GO)

    @model_validator(mode="after")
    def _lr_order(self) -> StageSpec:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        return self


class CheckpointSpec(Section):
    interval: int = Field(
        20,
        gt=0,
        description="Persist a checkpoint to storage every this many steps (and always at a stage's last step).",
    )
    memory_interval: int = Field(
        5,
        ge=0,
        description="Flash checkpoints: snapshot the training state into shared memory every this many steps "
        "(training blocks only for the copy; the node's saver persists every `interval` steps). 0 writes checkpoints "
        "straight to storage instead.",
    )
    keep: int = Field(
        3,
        ge=1,
        description="Committed checkpoints kept per stage (older ones are deleted; the latest and the good one never "
        "are).",
    )
    shm_dir: str = Field("/dev/shm", description="Directory on a memory filesystem for the snapshot buffers.")
    shm_fallback: bool = Field(
        False, description="If shared memory is too small for the snapshots, persist directly instead of failing."
    )
    uri: str | None = Field(
        None,
        description="Where checkpoints are stored: empty → <workdir>/checkpoints; or 's3://bucket/prefix'. S3 "
        "credentials come from the standard AWS environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, a "
        "role), never from the spec.",
    )
    s3_endpoint_url: str | None = Field(
        None, description="Endpoint of an S3-compatible server (MinIO, SeaweedFS, …); empty → AWS."
    )
    s3_region: str | None = Field(None, description="S3 region; empty → the AWS environment's default.")
    state_uri: str | None = Field(
        None,
        description="Where the campaign's state (ledger, lease) lives: empty → the workdir, and a file lock keeps "
        "two runs apart on this machine; or shared storage ('s3://bucket/prefix', same endpoint and credentials as "
        "the checkpoints, or a shared directory), where a lease keeps two runs apart wherever they run.",
    )

    @field_validator("uri", "s3_endpoint_url", "state_uri")
    @classmethod
    def _no_credentials(cls, url: str | None) -> str | None:
        return no_credentials_in_url(url, S3_CREDENTIALS_GO)

    @model_validator(mode="after")
    def _s3_only_options(self) -> CheckpointSpec:
        if (self.s3_endpoint_url or self.s3_region) and not any(
            (u or "").startswith("s3://") for u in (self.uri, self.state_uri)
        ):
            raise ValueError("s3_endpoint_url / s3_region only apply when uri or state_uri is an s3:// URL")
        return self

    @model_validator(mode="after")
    def _persist_on_snapshots(self) -> CheckpointSpec:
        if self.memory_interval and self.interval % self.memory_interval:
            raise ValueError(
                f"interval ({self.interval}) must be a multiple of memory_interval ({self.memory_interval}): "
                "checkpoints are persisted from memory snapshots"
            )
        return self


class TrackingSpec(Section):
    uri: str | None = Field(
        None,
        description="MLflow tracking URI; default: MLFLOW_TRACKING_URI, else 'sqlite:///<cwd>/mlflow.db' (one store "
        "shared by the campaigns run from a directory; a workdir with its own mlflow.db keeps it). Recorded in the ledger: a resumed campaign uses the store it started with.",
    )
    experiment: str = Field("pretrain", min_length=1, description="MLflow experiment name.")
    log_every: int = Field(1, gt=0, description="Log training metrics every this many steps.")
    register_model: bool = Field(
        True,
        description="When the campaign completes, export its final good checkpoint (Hugging Face GPT-2 layout), log "
        "it as a model of the campaign's MLflow run with its eval metrics and register it in the model registry "
        "(MLflow's transformers flavor).",
    )
    registered_model: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Registered model name in the MLflow model registry (letters, digits, '_', '.', '-'); empty → "
        "the campaign name.",
    )
    model_alias: str = Field(
        "latest-good",
        pattern=r"^[A-Za-z][A-Za-z0-9_-]*$",
        description="Registry alias moved to each newly registered version: load it as models:/<name>@<alias>.",
    )
    registration_wait_s: float = Field(
        120,
        ge=0,
        description="How long the end of a campaign retries registering the final model while MLflow does "
        "not answer (tries after 2, 10, 30 and 60 s, as many as fit). Past it the campaign completes anyway with the "
        "registration pending (`pretrain status` says so) and its next run registers the model, training nothing "
        "again.",
    )

    @field_validator("uri")
    @classmethod
    def _no_credentials(cls, url: str | None) -> str | None:
        return no_credentials_in_url(url, MLFLOW_CREDENTIALS_GO)

    @field_validator("model_alias")
    @classmethod
    def _alias_not_reserved(cls, alias: str) -> str:
        if alias.lower() == "latest" or (alias[0] in "vV" and alias[1:].isdigit()):
            raise ValueError(f"{alias!r} is reserved by MLflow ('latest', 'v<number>'): choose another alias")
        return alias


class ValidationSpec(Section):
    probe_windows: int = Field(
        16,
        ge=1,
        description="Held-out sequences (the first of the validation split, the same for every checkpoint) in the "
        "gate's probe loss.",
    )
    probe_tolerance: float = Field(
        0.5,
        gt=0,
        description="A checkpoint whose probe loss exceeds the training loss recorded at its step by more than this "
        "fraction is bad (diverged or damaged weights).",
    )
    eval_every: int = Field(
        1,
        ge=0,
        description="Evaluate every Nth good checkpoint during training (val loss, perplexity, accuracy → MLflow at "
        "its step); 0: only each stage's final one.",
    )
    eval_batches: int = Field(16, ge=1, description="Validation batches (of 8 sequences) per evaluation.")


class ResumeSpec(Section):
    max_attempts: int = Field(
        3, ge=1, description="Job launches per stage (first run + automatic resumes) before the stage fails."
    )
    grace_period_s: float = Field(
        300,
        gt=0,
        description="Ctrl-C or SIGTERM to `pretrain run` pauses the campaign (the job's final checkpoint "
        "saved and validated) within this many seconds; past them everything is stopped at once, the campaign is "
        "recorded interrupted and the next run resumes from the last good checkpoint.",
    )


class FaultToleranceSpec(Section):
    startup_timeout_s: float = Field(
        600, gt=0, description="A worker with no heartbeat for this long while starting (rendezvous, restore) is hung."
    )
    step_timeout_s: float = Field(
        300,
        gt=0,
        description="A worker whose training step makes no progress for this long is hung: the job's workers restart "
        "from the newest snapshot.",
    )
    checkpoint_timeout_s: float = Field(
        600, gt=0, description="A worker stuck this long in a checkpoint (copy or final commit) is hung."
    )
    hang_timeout_factor: float = Field(
        5.0,
        ge=0,
        description="After `hang_warmup_steps` steps, a worker's step timeout is this multiple of the p99 of its "
        "recent step durations (never above `step_timeout_s`, never below `hang_timeout_floor_s`), so a hang is found in seconds; 0: `step_timeout_s` only.",
    )
    hang_timeout_floor_s: float = Field(
        5.0, gt=0, description="The adapted step timeout is never shorter than this (a machine's hiccup is not a hang)."
    )
    hang_warmup_steps: int = Field(
        10,
        ge=1,
        description="Steps a worker (also a restarted one) observes before its step timeout adapts; until then "
        "`step_timeout_s` applies.",
    )
    spike_zscore: float = Field(
        8.0,
        ge=0,
        description="A loss more than this many robust standard deviations (MAD) above the trailing median is a "
        "spike; 0 disables spike detection (NaN/Inf is always caught).",
    )
    spike_window: int = Field(50, ge=2, description="Steps in the trailing window of the spike detector.")
    spike_min_steps: int = Field(20, ge=2, description="Steps the detector observes before it judges spikes.")
    max_rollbacks: int = Field(
        3,
        ge=0,
        description="Loss anomalies (NaN/Inf or spike) per stage that are rolled back and skipped before the stage "
        "fails.",
    )
    rollback_in_process: bool = Field(
        True,
        description="Roll a loss anomaly back inside the running workers (each restores the newest snapshot all "
        "ranks hold, in well under a second); false: restart the job's workers, which restore it on start-up (seconds).",
    )
    node_check_threshold: float = Field(
        2.0, gt=1, description="A node whose health check is slower than this multiple of the median is excluded."
    )
    saver_max_failures: int = Field(
        5,
        ge=1,
        description="A node's checkpoint saver that fails this many times in a row (restarted with a backoff "
        "doubling from `saver_backoff_s` up to 60 s; training goes on on its memory snapshots meanwhile) fails the job with the saver's error.",
    )
    fast_recovery_timeout_s: float = Field(
        30.0,
        ge=0,
        description="When a worker of a DDP job over gloo dies, the others (on every node) are kept and a spare (one "
        "node) or a replacement its node's agent starts takes its rank (docs/recovery.md); if they are not all restored in a new process group within this many seconds, every worker is restarted instead (the full restart). 0: always the full restart.",
    )
    saver_backoff_s: float = Field(
        1.0,
        gt=0,
        description="First wait before a failed checkpoint saver is restarted; doubles with each failure in a row "
        "(up to 60 s).",
    )
    storage_outage_s: float = Field(
        600.0,
        gt=0,
        description="How long the checkpoint storage may stay unreachable (S3 down, timing out, failing on its side) "
        "while a job trains: its savers are restarted meanwhile without counting toward `saver_max_failures`, training goes on on memory snapshots, and the newest one is persisted once the storage answers; unreachable longer, the job fails with the storage's error.",
    )


# ---- chaos drills: one model per kind, each with only its own fields (``kind`` picks the model) ----
class _Drill(Section):
    stage: str | None = Field(None, description="Stage in which the drill fires (default: the first stage).")
    step: int = Field(
        1,
        ge=1,
        description="Fires when training reaches this step of the stage (once per stage, never again after the "
        "restart).",
    )


class _WorkerDrill(_Drill):
    rank: int = Field(0, ge=0, description="Global rank of the worker the drill acts on.")


class _NodeDrill(_Drill):
    node: int = Field(0, ge=0, description="Index of the node the drill acts on.")


class KillWorker(_WorkerDrill):
    kind: Literal["kill_worker"] = Field(
        description="SIGKILL the worker at `step`: its node's agent restarts the workers from the newest memory "
        "snapshot."
    )


class HangWorker(_WorkerDrill):
    kind: Literal["hang_worker"] = Field(
        description="The worker stops making progress at `step`: the hang detector must restart the workers."
    )


class NanLoss(_WorkerDrill):
    kind: Literal["nan_loss"] = Field(
        description="The worker's loss at `step` is NaN: the step is rolled back and its samples skipped."
    )


class LossSpike(_WorkerDrill):
    kind: Literal["loss_spike"] = Field(
        description="The worker's loss at `step` is multiplied by `factor`: the spike detector rolls it back."
    )
    factor: float = Field(20.0, gt=1, description="What the loss of that step is multiplied by.")


class SlowWorker(_WorkerDrill):
    kind: Literal["slow_worker"] = Field(
        description="The worker is a straggler from `step` on (no marker: every step), and its node check is slowed "
        "too."
    )
    delay_s: float = Field(
        0.2,
        ge=0,
        description="Extra seconds per step from `step` on, and a proportional slowdown of its node check (the one "
        "before training if `step` is 1, else the one after the next restart).",
    )


class KillSaver(_NodeDrill):
    kind: Literal["kill_saver"] = Field(
        description="Kill the node's checkpoint saver at `step`: the agent restarts it; training goes on meanwhile."
    )


class KillNode(_NodeDrill):
    kind: Literal["kill_node"] = Field(
        description="Kill the whole node (agent, workers, saver) at `step`: training goes on without it (elastic) "
        "and it rejoins after `cluster.rejoin_after_s`."
    )


class FreezeNode(_NodeDrill):
    kind: Literal["freeze_node"] = Field(
        description="Freeze the whole node (SIGSTOP to agent, workers, saver) at `step`, as a hung machine: nothing "
        "exits and no socket closes. The rendezvous drops it once its keep-alives lapse (`cluster.node_timeout_s`) and training goes on without it; the orchestrator stops it for good once its agent has been silent for `PRETRAIN_NODE_SILENT_S` (local cluster)."
    )


class CorruptCheckpoint(_Drill):
    kind: Literal["corrupt_checkpoint"] = Field(
        description="Flip one byte of the model state of the checkpoint persisted at `step` (silent storage "
        "corruption: the validation gate must catch it)."
    )


DRILL_KINDS = {
    m.model_fields["kind"].annotation.__args__[0]: m
    for m in (
        KillWorker,
        HangWorker,
        NanLoss,
        LossSpike,
        SlowWorker,
        KillSaver,
        KillNode,
        FreezeNode,
        CorruptCheckpoint,
    )
}


def _drill_kind(value) -> str | None:
    return value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)


ChaosDrill = Annotated[
    Union[tuple(Annotated[model, Tag(kind)] for kind, model in DRILL_KINDS.items())],  # noqa: UP007 - built at run time
    Discriminator(
        _drill_kind,
        custom_error_type="drill_kind",
        custom_error_message=f"`kind` must be one of {', '.join(DRILL_KINDS)}",
    ),
]


class SkipWindow(Section):
    stage: str = Field(..., description="Stage whose data order the window refers to.")
    start: int = Field(..., ge=0, description="First global sample position skipped.")
    end: int = Field(..., gt=0, description="First global sample position no longer skipped.")

    @model_validator(mode="after")
    def _ordered(self) -> SkipWindow:
        if self.end <= self.start:
            raise ValueError(f"end ({self.end}) must be greater than start ({self.start})")
        return self


class BlockRefs(Section):
    """Saved Prefect blocks a spec refers to by name instead of inline settings (resolved by the
    campaign flow; the core never talks to Prefect)."""

    storage: str | None = Field(
        None,
        description="Campaign storage block as '<block-type-slug>/<name>', e.g. 'local-campaign-storage/shared' or "
        "'s3-campaign-storage/prod': decides the workdir (and, for S3, where checkpoints go and their credentials). "
        "Replaces `workdir` and `checkpoint.uri` / `s3_*`.",
    )
    cluster: str | None = Field(
        None,
        description="Cluster block as '<block-type-slug>/<name>', e.g. 'local-process-cluster/two-workers'. "
        "Replaces the `cluster` section.",
    )
    tracking: str | None = Field(
        None,
        description="MLflow tracking block as '<block-type-slug>/<name>', e.g. 'mlflow-tracking/team'. Replaces "
        "`tracking.uri` and `tracking.experiment` (a token stays in the block).",
    )

    def any(self) -> bool:
        return any((self.storage, self.cluster, self.tracking))
