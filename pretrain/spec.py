"""The campaign spec: one pydantic model, loaded from YAML, that drives a whole campaign.

Every field has a description (``pretrain spec-schema`` prints them) and a default that works
on a laptop. Invalid files fail before anything runs, naming the file, the field path and the
reason (:class:`SpecError`).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import string
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from pretrain.credentials import Credentials
from pretrain.redact import url_credentials

BUILTIN_PREFIX = "builtin:"
MAX_STEPS = 99_999_999  # step directories are named with 8 digits (step_00000040)
S3_CREDENTIALS_GO = ("S3 credentials come from the AWS environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
                     "an instance or IRSA role) or from an s3-campaign-storage block's credentials (stored as secrets)")
MLFLOW_CREDENTIALS_GO = ("MLflow credentials come from MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD or "
                         "MLFLOW_TRACKING_TOKEN in the environment, or from an mlflow-tracking block's token")


class SpecError(ValueError):
    """A campaign spec could not be read or is invalid; the message says where and why."""


def no_credentials_in_url(url: str | None, where: str) -> str | None:
    """``url`` unchanged, or a ValueError saying that credentials do not belong in it and ``where`` they go."""
    found = url_credentials(url) if url else None
    if found:
        raise ValueError(f"must not contain credentials ({found}): {where}; the URI itself is recorded in the "
                         "ledger, MLflow and logs")
    return url


class FieldProblem(ValueError):
    """A cross-field rule that fails on one field: the error is reported under ``field``'s path."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value, info: ValidationInfo):
        """YAML's ``true`` is not a number: a bool for an int or float field is refused, not read as 1."""
        if isinstance(value, bool) and cls.model_fields[info.field_name].annotation in (int, float):
            raise ValueError(f"expected a number, got {str(value).lower()} (a number is not a boolean)")
        return value


class TokenizerSpec(_Section):
    vocab_size: int = Field(2048, ge=260, le=65535, description="BPE vocabulary size (byte-level; at least 256 bytes + specials).")
    min_frequency: int = Field(2, ge=1, description="Minimum pair frequency for a BPE merge.")


class DataSpec(_Section):
    sources: list[str] | dict[str, list[str]] = Field(
        default_factory=lambda: ["{stdlib}/json/*.py"],
        description="Text files or glob patterns to train on; '{stdlib}' expands to the Python standard library "
        "directory, so the demo needs nothing from outside; '**' recurses. A mapping of group name → patterns "
        "makes named data groups that stages can mix in chosen proportions (`stages[].mixture`); a plain list is "
        "one group named 'all'.",
    )
    max_bytes: int = Field(8_000_000, gt=0, description="Stop reading sources after this many bytes, per group (keeps demos small).")
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec, description="Tokenizer training settings.")
    val_fraction: float = Field(0.05, gt=0.0, lt=0.5, description="Fraction of documents held out for validation/evaluation.")
    shard_tokens: int = Field(1_000_000, gt=0, description="Tokens per packed shard file.")

    @model_validator(mode="after")
    def _groups_named(self) -> "DataSpec":
        groups = self.groups()
        if not groups or not all(groups.values()):
            raise ValueError("sources must name at least one file pattern (in every group)")
        bad = [g for g in groups if not re.fullmatch(r"[A-Za-z0-9_-]+", g)]
        if bad:
            raise ValueError(f"data group names may use letters, digits, '-', '_' only: {bad}")
        return self

    def groups(self) -> dict[str, list[str]]:
        """Named groups of source patterns ('all' for a plain list)."""
        return dict(self.sources) if isinstance(self.sources, dict) else {"all": list(self.sources)}


class ModelSpec(_Section):
    n_layer: int = Field(4, ge=1, description="Transformer blocks.")
    n_head: int = Field(4, ge=1, description="Attention heads per block.")
    d_model: int = Field(128, ge=8, description="Hidden size; must be divisible by n_head.")
    max_seq_len: int = Field(256, ge=8, description="Longest sequence the position table supports; every stage's seq_len must fit.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability (0 keeps runs bitwise reproducible).")

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelSpec":
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        return self


class ClusterSpec(_Section):
    kind: Literal["local"] = Field("local", description="Where workers run: 'local' processes (Kubernetes comes later).")
    workers_per_node: int = Field(2, ge=1, description="Training processes per node (one per accelerator; on CPU one per core is sensible).")
    nodes_min: int = Field(1, ge=1, description="Fewest nodes the job may run with (elastic lower bound).")
    nodes_max: int = Field(1, ge=1, description="Most nodes the job starts with (elastic upper bound).")
    max_restarts: int = Field(2, ge=0, description="In-job restarts by the elastic agent before the job counts as failed.")
    rejoin_after_s: float = Field(
        60.0, ge=0, description="A node lost during a job is health-checked again after this many seconds; if it passes, "
        "the job is stopped (the savers persist the newest snapshot) and relaunched on all nodes — the cluster scales "
        "back up with the same global batch and exact data position. 0: keep the smaller world until the job ends.")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="Collective backend: 'auto' picks NCCL on GPU, gloo on CPU.")
    parallelism: Literal["ddp", "fsdp"] = Field(
        "ddp", description="Data parallelism: 'ddp' replicates model and optimizer on every worker (rank 0 checkpoints "
        "them); 'fsdp' shards them across the workers with FSDP2 (per block + root), and every worker checkpoints its "
        "own shard. Checkpoints of either kind can start or resume a stage of the other (docs/fault-tolerance.md).")
    threads_per_worker: int = Field(0, ge=0, description="torch threads per worker; 0 divides the machine's cores among workers.")

    @model_validator(mode="after")
    def _bounds(self) -> "ClusterSpec":
        if self.nodes_min > self.nodes_max:
            raise ValueError(f"nodes_min ({self.nodes_min}) must not exceed nodes_max ({self.nodes_max})")
        return self


class StageSpec(_Section):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]+$", description="Stage name (letters, digits, '-', '_'); used in paths and MLflow.")
    steps: int = Field(..., gt=0, le=MAX_STEPS, description="Optimizer steps in this stage (below 10^8: step directories have 8 digits).")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate.")
    min_lr: float = Field(3e-4, ge=0, description="Learning rate at the end of the cosine decay.")
    warmup_steps: int = Field(10, ge=0, description="Linear warm-up steps before cosine decay.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the global gradient norm to this value.")
    micro_batch: int = Field(8, gt=0, description="Sequences per worker per forward/backward.")
    grad_accum: int = Field(1, gt=0, description="Micro-batches accumulated per optimizer step.")
    seq_len: int = Field(128, ge=8, description="Tokens per training sequence.")
    mixture: dict[str, float] = Field(
        default_factory=dict, description="Data group → weight (any positive scale): the stage draws its samples from "
        "the groups in these proportions, exactly and resumably. Empty: the whole training split in one order.")
    carry_optimizer: bool = Field(True, description="Start from the previous stage's optimizer state (AdamW moments); false resets it. The model weights always carry over.")

    @model_validator(mode="after")
    def _lr_order(self) -> "StageSpec":
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        return self


class CheckpointSpec(_Section):
    interval: int = Field(20, gt=0, description="Persist a checkpoint to storage every this many steps (and always at a stage's last step).")
    memory_interval: int = Field(
        5, ge=0, description="Flash checkpoints: snapshot the training state into shared memory every this many steps "
        "(training blocks only for the copy; the node's saver persists every `interval` steps). 0 writes checkpoints "
        "straight to storage instead.")
    keep: int = Field(3, ge=1, description="Committed checkpoints kept per stage (older ones are deleted; the latest and the good one never are).")
    shm_dir: str = Field("/dev/shm", description="Directory on a memory filesystem for the snapshot buffers.")
    shm_fallback: bool = Field(False, description="If shared memory is too small for the snapshots, persist directly instead of failing.")
    uri: str | None = Field(
        None, description="Where checkpoints are stored: empty → <workdir>/checkpoints; or 's3://bucket/prefix'. S3 "
        "credentials come from the standard AWS environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, a "
        "role), never from the spec.")
    s3_endpoint_url: str | None = Field(None, description="Endpoint of an S3-compatible server (MinIO, SeaweedFS, …); empty → AWS.")
    s3_region: str | None = Field(None, description="S3 region; empty → the AWS environment's default.")

    @field_validator("uri", "s3_endpoint_url")
    @classmethod
    def _no_credentials(cls, url: str | None) -> str | None:
        return no_credentials_in_url(url, S3_CREDENTIALS_GO)

    @model_validator(mode="after")
    def _s3_only_options(self) -> "CheckpointSpec":
        if (self.s3_endpoint_url or self.s3_region) and not (self.uri or "").startswith("s3://"):
            raise ValueError("s3_endpoint_url / s3_region only apply when uri is an s3:// URL")
        return self

    @model_validator(mode="after")
    def _persist_on_snapshots(self) -> "CheckpointSpec":
        if self.memory_interval and self.interval % self.memory_interval:
            raise ValueError(f"interval ({self.interval}) must be a multiple of memory_interval ({self.memory_interval}): "
                             "checkpoints are persisted from memory snapshots")
        return self


class TrackingSpec(_Section):
    uri: str | None = Field(None, description="MLflow tracking URI; default 'sqlite:///<workdir>/mlflow.db'.")
    experiment: str = Field("pretrain", min_length=1, description="MLflow experiment name.")
    log_every: int = Field(1, gt=0, description="Log training metrics every this many steps.")
    register_model: bool = Field(
        True, description="When the campaign completes, export its final good checkpoint (Hugging Face GPT-2 layout), log "
        "it as a model of the campaign's MLflow run with its eval metrics and register it in the model registry "
        "(MLflow's transformers flavor).")
    registered_model: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Registered model name in the MLflow model registry (letters, digits, '_', '.', '-'); empty → the campaign name.")
    model_alias: str = Field(
        "latest-good", pattern=r"^[A-Za-z][A-Za-z0-9_-]*$",
        description="Registry alias moved to each newly registered version: load it as models:/<name>@<alias>.")

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


class ValidationSpec(_Section):
    probe_windows: int = Field(16, ge=1, description="Held-out sequences (the first of the validation split, the same for every checkpoint) in the gate's probe loss.")
    probe_tolerance: float = Field(0.5, gt=0, description="A checkpoint whose probe loss exceeds the training loss recorded at its step by more than this fraction is bad (diverged or damaged weights).")
    eval_every: int = Field(1, ge=0, description="Evaluate every Nth good checkpoint during training (val loss, perplexity, accuracy → MLflow at its step); 0: only each stage's final one.")
    eval_batches: int = Field(16, ge=1, description="Validation batches (of 8 sequences) per evaluation.")


class ResumeSpec(_Section):
    max_attempts: int = Field(3, ge=1, description="Job launches per stage (first run + automatic resumes) before the stage fails.")


class FaultToleranceSpec(_Section):
    startup_timeout_s: float = Field(600, gt=0, description="A worker with no heartbeat for this long while starting (rendezvous, restore) is hung.")
    step_timeout_s: float = Field(300, gt=0, description="A worker whose training step makes no progress for this long is hung: the job's workers restart from the newest snapshot.")
    checkpoint_timeout_s: float = Field(600, gt=0, description="A worker stuck this long in a checkpoint (copy or final commit) is hung.")
    spike_zscore: float = Field(8.0, ge=0, description="A loss more than this many robust standard deviations (MAD) above the trailing median is a spike; 0 disables spike detection (NaN/Inf is always caught).")
    spike_window: int = Field(50, ge=2, description="Steps in the trailing window of the spike detector.")
    spike_min_steps: int = Field(20, ge=2, description="Steps the detector observes before it judges spikes.")
    max_rollbacks: int = Field(3, ge=0, description="Loss anomalies (NaN/Inf or spike) per stage that are rolled back and skipped before the stage fails.")
    node_check_threshold: float = Field(2.0, gt=1, description="A node whose health check is slower than this multiple of the median is excluded.")
    saver_max_failures: int = Field(5, ge=1, description="A node's checkpoint saver that fails this many times in a row (restarted with a backoff doubling from 1 s up to 60 s; training goes on on its memory snapshots meanwhile) fails the job with the saver's error.")


class ChaosDrill(_Section):
    kind: Literal["kill_worker", "hang_worker", "nan_loss", "loss_spike", "slow_worker", "kill_saver", "kill_node",
                  "corrupt_checkpoint"] = Field(
        ..., description="Fault to inject: kill or hang a worker, make the loss NaN or spike, slow a worker (and its node check), kill the node's checkpoint saver, kill a whole node, flip a byte of the checkpoint persisted at `step` (silent storage corruption: the validation gate must catch it).")
    stage: str | None = Field(None, description="Stage in which the drill fires (default: the first stage).")
    step: int = Field(1, ge=1, description="Fires when training reaches this step of the stage (once per stage, never again after the restart).")
    rank: int = Field(0, ge=0, description="Worker rank for worker drills.")
    node: int = Field(0, ge=0, description="Node index for kill_node / kill_saver.")
    delay_s: float = Field(0.2, ge=0, description="slow_worker: extra seconds per step from `step` on, and a proportional slowdown of its node check (the one before training if `step` is 1, else the one after the next restart).")
    factor: float = Field(20.0, gt=1, description="loss_spike: the loss of that step is multiplied by this.")


class SkipWindow(_Section):
    stage: str = Field(..., description="Stage whose data order the window refers to.")
    start: int = Field(..., ge=0, description="First global sample position skipped.")
    end: int = Field(..., gt=0, description="First global sample position no longer skipped.")

    @model_validator(mode="after")
    def _ordered(self) -> "SkipWindow":
        if self.end <= self.start:
            raise ValueError(f"end ({self.end}) must be greater than start ({self.start})")
        return self


class BlockRefs(_Section):
    """Saved Prefect blocks a spec refers to by name instead of inline settings (resolved by the
    campaign flow; the core never talks to Prefect)."""

    storage: str | None = Field(
        None, description="Campaign storage block as '<block-type-slug>/<name>', e.g. 'local-campaign-storage/shared' or "
        "'s3-campaign-storage/prod': decides the workdir (and, for S3, where checkpoints go and their credentials). "
        "Replaces `workdir` and `checkpoint.uri` / `s3_*`.")
    cluster: str | None = Field(
        None, description="Cluster block as '<block-type-slug>/<name>', e.g. 'local-process-cluster/two-workers'. "
        "Replaces the `cluster` section.")
    tracking: str | None = Field(
        None, description="MLflow tracking block as '<block-type-slug>/<name>', e.g. 'mlflow-tracking/team'. Replaces "
        "`tracking.uri` and `tracking.experiment` (a token stays in the block).")

    def any(self) -> bool:
        return any((self.storage, self.cluster, self.tracking))


class CampaignSpec(_Section):
    name: str = Field("tiny", pattern=r"^[A-Za-z0-9_.-]+$", description="Campaign name (tags the MLflow runs; one path component of the workdir, not '.' or '..').")
    workdir: str = Field("./runs/{name}", description="Where the campaign keeps its state: data, checkpoints, ledger, MLflow db. '{name}' expands ('{{' and '}}' are literal braces).")
    seed: int = Field(1234, description="Seed for model init, data order and every rank's RNG.")
    data: DataSpec = Field(default_factory=DataSpec, description="Corpus, tokenizer and sharding.")
    model: ModelSpec = Field(default_factory=ModelSpec, description="GPT dimensions.")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Where and how many workers train.")
    stages: list[StageSpec] = Field(
        default_factory=lambda: [StageSpec(name="warmup", steps=40), StageSpec(name="main", steps=120)],
        min_length=1,
        description="Training stages, run in order; each starts from the previous stage's final checkpoint.",
    )
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpoint cadence and retention.")
    validation: ValidationSpec = Field(default_factory=ValidationSpec, description="The validation gate (only checkpoints that pass it are resumed from) and evaluation during training.")
    tracking: TrackingSpec = Field(default_factory=TrackingSpec, description="MLflow tracking.")
    resume: ResumeSpec = Field(default_factory=ResumeSpec, description="Automatic resume after failures.")
    fault_tolerance: FaultToleranceSpec = Field(default_factory=FaultToleranceSpec, description="Hang and loss-anomaly detection, node checks.")
    chaos: list[ChaosDrill] = Field(default_factory=list, description="Faults injected on purpose to rehearse recovery (chaos drills).")
    skip_samples: list[SkipWindow] = Field(default_factory=list, description="Sample windows never trained on (e.g. to reproduce a run that rolled back a loss spike).")
    blocks: BlockRefs = Field(default_factory=BlockRefs, description="Saved Prefect blocks to take storage, cluster or tracking settings from, by name.")

    _credentials: Credentials = PrivateAttr(default_factory=Credentials)  # from blocks; never dumped or hashed

    @field_validator("name")
    @classmethod
    def _one_path_component(cls, name: str) -> str:
        if name in (".", ".."):
            raise ValueError(f"{name!r} is not a campaign name: it names a directory, not one of its own ('.' or '..')")
        return name

    @field_validator("workdir")
    @classmethod
    def _only_name_expands(cls, workdir: str) -> str:
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(workdir) if f is not None]
        except ValueError as err:
            raise ValueError(f"{workdir!r} is not a valid template ({err}); only '{{name}}' expands, "
                             "write '{{' and '}}' for literal braces") from None
        unknown = [f"{{{f}}}" for f in fields if f != "name"]
        if unknown:
            raise ValueError(f"{workdir!r} uses {', '.join(unknown)}: only '{{name}}' expands, "
                             "write '{{' and '}}' for literal braces")
        return workdir

    @model_validator(mode="after")
    def _chaos_in_cluster(self) -> "CampaignSpec":
        if self.blocks.cluster:
            return self  # the cluster block decides the world; checked again once it is resolved
        c = self.cluster
        for i, drill in enumerate(self.chaos):
            if drill.rank >= c.workers_per_node * c.nodes_max:
                raise FieldProblem(f"chaos.{i}.rank", f"rank {drill.rank} does not exist, the cluster has "
                                 f"{c.workers_per_node * c.nodes_max} workers (ranks 0..{c.workers_per_node * c.nodes_max - 1})")
            if drill.node >= c.nodes_max:
                raise FieldProblem(f"chaos.{i}.node", f"node {drill.node} does not exist, the cluster has {c.nodes_max} "
                                 f"node(s) (0..{c.nodes_max - 1})")
        return self

    @model_validator(mode="after")
    def _blocks_or_inline(self) -> "CampaignSpec":
        # by value, not by fields set: a spec that went through JSON (a deployment parameter) has every field set
        default = CampaignSpec.model_fields
        clashes = {
            "storage": (["workdir"] if self.workdir != default["workdir"].default else [])
            + (["checkpoint.uri"] if self.checkpoint.uri else []),
            "cluster": ["cluster"] if self.cluster != ClusterSpec() else [],
            "tracking": [f"tracking.{f}" for f in ("uri", "experiment")
                         if getattr(self.tracking, f) != TrackingSpec.model_fields[f].default],
        }
        for ref, fields in clashes.items():
            if getattr(self.blocks, ref) and fields:
                raise ValueError(f"blocks.{ref} and {', '.join(fields)} both give the same settings: keep only one of them")
        return self

    @model_validator(mode="after")
    def _stages_fit(self) -> "CampaignSpec":
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        for i, s in enumerate(self.stages):
            if s.seq_len > self.model.max_seq_len:
                raise ValueError(f"stages[{i}].seq_len ({s.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len})")
        groups = set(self.data.groups())
        for i, s in enumerate(self.stages):
            unknown = sorted(set(s.mixture) - groups)
            if unknown:
                raise ValueError(f"stages[{i}].mixture names data group(s) {unknown}; data.sources defines {sorted(groups)}")
            if s.mixture and not any(w > 0 for w in s.mixture.values()) or any(w < 0 for w in s.mixture.values()):
                raise ValueError(f"stages[{i}].mixture weights must be >= 0 with at least one > 0")
        for i, ref in enumerate([d.stage for d in self.chaos] + [w.stage for w in self.skip_samples]):
            if ref is not None and ref not in names:
                raise ValueError(f"chaos / skip_samples refer to stage {ref!r}, which is not one of {names}")
        return self

    # ---- derived values -------------------------------------------------------------------
    @property
    def workdir_path(self) -> Path:
        return Path(self.workdir.format(name=self.name)).expanduser().resolve()

    @property
    def tracking_uri(self) -> str:
        return self.tracking.uri or f"sqlite:///{self.workdir_path / 'mlflow.db'}"

    @property
    def registered_model_name(self) -> str:
        return self.tracking.registered_model or self.name

    def stage_index(self, name: str) -> int:
        """Position of the stage called ``name`` in ``stages``."""
        for i, stage in enumerate(self.stages):
            if stage.name == name:
                return i
        raise ValueError(f"campaign {self.name!r} has no stage {name!r} (stages: {[s.name for s in self.stages]})")

    def spec_hash(self) -> str:
        """Hash of everything that defines the campaign's results (not where it is stored).
        Fields left at their defaults are not hashed, so a release that adds a field (with a
        default) does not orphan existing workdirs; block references are hashed as resolved."""
        body = self.model_dump(mode="json", exclude={"workdir", "blocks"}, exclude_defaults=True)
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def credentials(self) -> Credentials:
        """The credentials of the spec's blocks, in this process's memory only (see pretrain.credentials)."""
        return self._credentials

    def with_credentials(self, credentials: Credentials) -> "CampaignSpec":
        copy = self.model_copy()
        copy._credentials = credentials
        return copy

    def with_workdir(self, workdir: str | Path | None) -> "CampaignSpec":
        return self if workdir is None else self.model_copy(update={"workdir": str(Path(workdir).expanduser().resolve())})


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid campaign spec {source}:"]
    for e in err.errors():
        problem = (e.get("ctx") or {}).get("error")
        if isinstance(problem, FieldProblem):
            lines.append(f"  {'.'.join([*map(str, e['loc']), problem.field])}: {problem}")
            continue
        path = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  {path}: {e['msg']}")
    lines.append("Fix the field(s) above; `pretrain spec-schema` lists every field with its description.")
    return "\n".join(lines)


def parse_spec(data: object, source: str = "<dict>") -> CampaignSpec:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"invalid campaign spec {source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        return CampaignSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(_format_error(err, source)) from None


def builtin_spec_path(name: str) -> Path:
    path = Path(str(resources.files("examples") / f"{name}.yaml"))
    if not path.is_file():
        raise SpecError(f"no built-in spec {name!r}; built-ins live in examples/*.yaml")
    return path


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error (YAML would
    silently keep the last one, so a typo'd override would win unnoticed)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key!r} (first on line {seen[key] + 1}); keep only one", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_spec(path: str | Path) -> CampaignSpec:
    """Read a spec from a YAML file (or 'builtin:<name>'), failing with a clear SpecError."""
    text_path = str(path)
    p = builtin_spec_path(text_path[len(BUILTIN_PREFIX):]) if text_path.startswith(BUILTIN_PREFIX) else Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as err:
        raise SpecError(f"cannot read campaign spec {p}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise SpecError(f"campaign spec {p} is not UTF-8 text (byte {err.start}: {err.reason}); save it as UTF-8") from None
    try:
        stream = io.StringIO(text)
        stream.name = str(p)  # YAML's messages name the file
        data = yaml.load(stream, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise SpecError(f"campaign spec {p} is not valid YAML: {err}") from None
    if data is None:
        raise SpecError(f"campaign spec {p} is empty: give at least the campaign's name and stages "
                        f"(`pretrain spec-schema` lists every field; `{BUILTIN_PREFIX}tiny` is the demo)")
    return parse_spec(data, str(p))


def resolve_spec(spec: CampaignSpec | None = None, spec_path: str | None = None,
                 workdir: str | Path | None = None) -> CampaignSpec:
    """The spec a flow was given: inline, else from ``spec_path``, else the built-in demo;
    ``workdir`` overrides where the campaign keeps its state."""
    if spec is None:
        spec = load_spec(spec_path or f"{BUILTIN_PREFIX}tiny")
    return spec.with_workdir(workdir)
