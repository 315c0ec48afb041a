"""The campaign spec: one pydantic model, loaded from YAML, that drives a whole campaign.

Every field has a description (``pretrain spec-schema`` prints them) and a default that works
on a laptop. Invalid files fail before anything runs, naming the file, the field path and the
reason (:class:`SpecError`). The sections live one module each in :mod:`pretrain.spec`
(``model``, ``cluster``, ``kube``, ``data``, ``stages``, ``checkpoints``, ``tracking``,
``fault_tolerance``, ``drills``, ``blocks``); reading YAML files in :mod:`pretrain.spec.file`.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import string
import typing
from pathlib import Path

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, field_validator, model_validator

from pretrain.credentials import Credentials
from pretrain.spec.base import Section
from pretrain.spec.blocks import BlockRefs
from pretrain.spec.checkpoints import CheckpointSpec, ValidationSpec
from pretrain.spec.cluster import ClusterSpec
from pretrain.spec.data import DataSpec
from pretrain.spec.drills import ChaosDrill
from pretrain.spec.fault_tolerance import FaultToleranceSpec, ResumeSpec
from pretrain.spec.layout import CampaignLayout
from pretrain.spec.model import ModelSpec
from pretrain.spec.stages import SkipWindow, StageSpec
from pretrain.spec.tracking import TrackingSpec
from pretrain.tracking.store import default_tracking_uri, recorded_store


class SpecError(ValueError):
    """A campaign spec could not be read or is invalid; the message says where and why."""


class FieldProblem(ValueError):
    """A cross-field rule that fails on one field: the error is reported under ``field``'s path."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class CampaignSpec(Section):
    name: str = Field(
        "tiny",
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Campaign name (tags the MLflow runs; one path component of the workdir, not '.' or '..').",
    )
    workdir: str = Field(
        "./runs/{name}",
        description="Where the campaign keeps its state: data, checkpoints, ledger, MLflow db. '{name}' expands "
        "('{{' and '}}' are literal braces).",
    )
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
    validation: ValidationSpec = Field(
        default_factory=ValidationSpec,
        description="The validation gate (only checkpoints that pass it are resumed from) and evaluation during "
        "training.",
    )
    tracking: TrackingSpec = Field(default_factory=TrackingSpec, description="MLflow tracking.")
    resume: ResumeSpec = Field(default_factory=ResumeSpec, description="Automatic resume after failures.")
    fault_tolerance: FaultToleranceSpec = Field(
        default_factory=FaultToleranceSpec, description="Hang and loss-anomaly detection, node checks."
    )
    chaos: list[ChaosDrill] = Field(
        default_factory=list, description="Faults injected on purpose to rehearse recovery (chaos drills)."
    )
    skip_samples: list[SkipWindow] = Field(
        default_factory=list,
        description="Sample windows never trained on (e.g. to reproduce a run that rolled back a loss spike).",
    )
    blocks: BlockRefs = Field(
        default_factory=BlockRefs,
        description="Saved Prefect blocks to take storage, cluster or tracking settings from, by name.",
    )

    _credentials: Credentials = PrivateAttr(default_factory=Credentials)  # from blocks; never dumped or hashed
    _tracking_uri: str | None = PrivateAttr(
        None
    )  # the store the ledger records (with_tracking_uri); never dumped or hashed

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
            raise ValueError(
                f"{workdir!r} is not a valid template ({err}); only '{{name}}' expands, "
                "write '{{' and '}}' for literal braces"
            ) from None
        unknown = [f"{{{f}}}" for f in fields if f != "name"]
        if unknown:
            raise ValueError(
                f"{workdir!r} uses {', '.join(unknown)}: only '{{name}}' expands, "
                "write '{{' and '}}' for literal braces"
            )
        return workdir

    @model_validator(mode="after")
    def _chaos_in_cluster(self) -> CampaignSpec:
        if self.blocks.cluster:
            return self  # the cluster block decides the world; checked again once it is resolved
        c = self.cluster
        for i, drill in enumerate(self.chaos):
            if getattr(drill, "rank", 0) >= c.workers_per_node * c.nodes_max:
                raise FieldProblem(
                    f"chaos.{i}.rank",
                    f"rank {drill.rank} does not exist, the cluster has "
                    f"{c.workers_per_node * c.nodes_max} workers (ranks 0..{c.workers_per_node * c.nodes_max - 1})",
                )
            if getattr(drill, "node", 0) >= c.node_count:
                raise FieldProblem(
                    f"chaos.{i}.node",
                    f"node {drill.node} does not exist, the cluster has {c.node_count} node(s) (0..{c.node_count - 1})",
                )
        return self

    @model_validator(mode="after")
    def _blocks_or_inline(self) -> CampaignSpec:
        # by value, not by fields set: a spec that went through JSON (a deployment parameter) has every field set
        default = CampaignSpec.model_fields
        clashes = {
            "storage": (["workdir"] if self.workdir != default["workdir"].default else [])
            + (["checkpoint.uri"] if self.checkpoint.uri else []),
            "cluster": ["cluster"] if self.cluster != ClusterSpec() else [],
            "tracking": [
                f"tracking.{f}"
                for f in ("uri", "experiment")
                if getattr(self.tracking, f) != TrackingSpec.model_fields[f].default
            ],
        }
        for ref, fields in clashes.items():
            if getattr(self.blocks, ref) and fields:
                raise ValueError(
                    f"blocks.{ref} and {', '.join(fields)} both give the same settings: keep only one of them"
                )
        return self

    @model_validator(mode="after")
    def _stages_fit(self) -> CampaignSpec:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        for i, s in enumerate(self.stages):
            if s.seq_len > self.model.max_seq_len:
                raise ValueError(
                    f"stages[{i}].seq_len ({s.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len})"
                )
        groups = set(self.data.groups())
        for i, s in enumerate(self.stages):
            unknown = sorted(set(s.mixture) - groups)
            if unknown:
                raise ValueError(
                    f"stages[{i}].mixture names data group(s) {unknown}; data.sources defines {sorted(groups)}"
                )
            if s.mixture and not any(w > 0 for w in s.mixture.values()) or any(w < 0 for w in s.mixture.values()):
                raise ValueError(f"stages[{i}].mixture weights must be >= 0 with at least one > 0")
        for ref in [d.stage for d in self.chaos] + [w.stage for w in self.skip_samples]:
            if ref is not None and ref not in names:
                raise ValueError(f"chaos / skip_samples refer to stage {ref!r}, which is not one of {names}")
        return self

    # ---- derived values -------------------------------------------------------------------
    @property
    def workdir_path(self) -> Path:
        return Path(self.workdir.format(name=self.name)).expanduser().resolve()

    @property
    def layout(self) -> CampaignLayout:
        """Where each of the campaign's files is under its workdir."""
        return CampaignLayout(self.workdir_path)

    @property
    def tracking_uri(self) -> str:
        """``tracking.uri``; else the store the campaign's ledger records (:meth:`with_tracking_uri`);
        else the default for a new campaign (:func:`pretrain.tracking.store.default_tracking_uri`)."""
        return self.tracking.uri or self._tracking_uri or default_tracking_uri(self.workdir_path)

    @property
    def registered_model_name(self) -> str:
        return self.tracking.registered_model or self.name

    def stage_index(self, name: str) -> int:
        """Position of the stage called ``name`` in ``stages``."""
        for i, stage in enumerate(self.stages):
            if stage.name == name:
                return i
        raise ValueError(f"campaign {self.name!r} has no stage {name!r} (stages: {[s.name for s in self.stages]})")

    def step_offset(self, stage_index: int) -> int:
        """The campaign step at which the stage at ``stage_index`` starts (its step 0): the
        steps of the stages before it. MLflow's campaign run and the registry count in it."""
        return sum(s.steps for s in self.stages[:stage_index])

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

    def with_credentials(self, credentials: Credentials) -> CampaignSpec:
        copy = self.model_copy()
        copy._credentials = credentials
        return copy

    def with_tracking_uri(self, recorded: str | None) -> CampaignSpec:
        """This spec using the tracking store its ledger recorded at creation (``recorded``), unless
        ``tracking.uri`` names one: a campaign finds its runs again from any directory."""
        uri = recorded_store(recorded)
        if self.tracking.uri or uri is None:
            return self
        copy = self.model_copy()
        copy._tracking_uri = uri
        return copy

    def with_workdir(self, workdir: str | Path | None) -> CampaignSpec:
        return (
            self if workdir is None else self.model_copy(update={"workdir": str(Path(workdir).expanduser().resolve())})
        )


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid campaign spec {source}:"]
    for e in err.errors():
        problem = (e.get("ctx") or {}).get("error")
        if isinstance(problem, FieldProblem):
            lines.append(f"  {'.'.join([*map(str, e['loc']), problem.field])}: {problem}")
            continue
        path = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  {path}: {e['msg']}{_did_you_mean(e['loc']) if e['type'] == 'extra_forbidden' else ''}")
    lines.append("Fix the field(s) above; `pretrain spec-schema` lists every field with its description.")
    return "\n".join(lines)


def _models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models a field's type holds (``X``, ``list[X]``, ``X | None``, a union of drills)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _tagged(model: type[BaseModel], tag: str) -> bool:
    """Whether ``tag`` is the value of one of ``model``'s literal fields (a union member's tag in an error's loc)."""
    return any(
        tag in typing.get_args(f.annotation)
        for f in model.model_fields.values()
        if typing.get_origin(f.annotation) is typing.Literal
    )


def _did_you_mean(loc: tuple) -> str:
    """`` (did you mean 'n_layer'?)`` for an unknown field whose name is close to one of the
    section's fields (a typo), else nothing."""
    models: list[type[BaseModel]] = [CampaignSpec]
    for part in loc[:-1]:
        if isinstance(part, int):  # a list's index
            continue
        holders = [m for m in models if part in m.model_fields]
        if holders:
            models = _models_in(holders[0].model_fields[part].annotation)
        else:  # a union member's tag, e.g. chaos.0.kill_worker.factor
            models = [m for m in models if _tagged(m, str(part))]
    names = sorted({n for m in models for n in m.model_fields})
    close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.75) if loc else []
    return f" (did you mean '{close[0]}'?)" if close else ""


def parse_spec(data: object, source: str = "<dict>") -> CampaignSpec:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"invalid campaign spec {source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        return CampaignSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(_format_error(err, source)) from None
