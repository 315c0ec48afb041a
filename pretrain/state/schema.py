"""The schema of ``ledger.json``: what the campaign ledger holds, typed.

Version 2 of the file; version 1 (written by the releases before, without a ``version`` key)
has the same keys and is read as is, keys it lacks taking their defaults. The key names are the
file's public shape (``pretrain status --json``, reports and tests read them), so they never
change meaning. Entries of a stage's lists (failures, resumes, ...) are written with exactly the
keys they were given: a failure inside a job and a failed job record different facts.
"""

from __future__ import annotations

import time
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_serializer

LEDGER_VERSION = 2  # what this release writes; it reads every version up to it


class CampaignStatus(StrEnum):
    """Where the campaign stands (``status`` of the ledger)."""

    NEW = "new"  # created, no run has started
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"  # a stage (or the final registration) failed
    CRASHED = "crashed"  # the infrastructure lost the run
    CANCELLED = "cancelled"  # cancelled in Prefect
    INTERRUPTED = "interrupted"  # Ctrl-C / SIGTERM to `pretrain run`
    PAUSED = "paused"  # a time-boxed run ended at a validated checkpoint; the next run continues (``end``: where)


class StageStatus(StrEnum):
    """Where a stage stands; the ways a run ends are the campaign's (:class:`CampaignStatus`)."""

    PENDING = "pending"
    RUNNING = "running"
    TRAINED = "trained"  # its last step is committed and good; validation and evaluation follow
    COMPLETED = "completed"
    FAILED = "failed"
    CRASHED = "crashed"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"
    PAUSED = "paused"  # a time-boxed run paused it at a validated checkpoint


OPEN_STAGES = (StageStatus.RUNNING, StageStatus.TRAINED)  # what a run was working on when it ended


class GivenKeys(BaseModel):
    """A record written with the keys it was given (unknown keys kept as they are): what an older
    release wrote reads and writes back unchanged, keys it lacks taking their defaults."""

    model_config = ConfigDict(extra="allow")

    def given_keys(self) -> set[str]:
        return self.model_fields_set | set(self.model_extra or ())

    @model_serializer(mode="wrap")
    def _given_keys_only(self, handler) -> dict[str, Any]:
        given = self.given_keys()
        return {k: v for k, v in handler(self).items() if k in given}


class Entry(GivenKeys):
    """One entry of a stage's history: written with the keys it was given (and ``time``, when it
    was recorded), unknown keys kept as they are."""

    time: float | None = None

    @model_serializer(mode="wrap")
    def _given_keys_only(self, handler) -> dict[str, Any]:
        given = self.given_keys()
        out = {k: v for k, v in handler(self).items() if k in given and k != "time"}
        return (
            out if "time" not in self.model_fields_set else {**out, "time": self.time}
        )  # last, as the release before wrote it

    def stamped(self) -> Entry:
        """This entry with ``time`` set to now if it has none."""
        if self.time is None:
            self.time = time.time()
        return self


class DataRecord(GivenKeys):
    """The campaign's data set: which one (``fingerprint``) and where (``location``), with the rest
    of its summary (counts, vocabulary, tokenizer) as preparation reported it. Checkpoints made
    in the campaign were trained on this data set; resuming them on another one is refused."""

    fingerprint: str | None = None
    location: str | None = None  # its directory or s3:// URL; None: the release before's flat <workdir>/data
    vocab_size: int | None = None

    def to_json(self) -> dict:
        return self.model_dump(mode="json")


class Failure(Entry):
    """A failure: recovered inside a job (``in_job``: restart of workers or saver) or of the whole
    job (the flow relaunched it, or stopped)."""

    attempt: int
    cause: str
    in_job: bool = False
    action: str = ""
    time_lost_s: float = 0.0
    exit_code: int | None = None  # a failed job's agent exit code
    errors: list[str] = Field(default_factory=list)  # what the workers reported
    log: str = ""  # the failed job's node agent log
    detected_at: float | None = (
        None  # when the fault was noticed (a hang: when the detector found it; a failed job: its end)
    )
    recovery_s: float | None = None  # until training stepped again (a failed job: its relaunch until the first step)
    steps_redone: int = 0
    # in-job: "in_process" (rolled back in the live workers), "spare"/"replacement" (a lost worker replaced, the others
    # kept), "restart" (new workers) or "spare_node" (new workers, a standby node for a lost one)
    recovery_path: str | None = None
    detection_s: float | None = None  # a hang: how long it went unnoticed (last heartbeat → detection)
    stacks: list[dict] = Field(
        default_factory=list
    )  # a hang: per hung rank, "where" it was (innermost frames) and "file", its threads' stacks in the job's directory


class Resume(Entry):
    """A (re)start of the workers in a job that loaded state (``source``: checkpoint, init, scratch ...)."""

    attempt: int
    restart_count: int = 0
    step: int = 0
    source: str = ""
    checkpoint: str | None = None


class Resize(Entry):
    """A planned relaunch: lost nodes passed their re-check and the job restarted on all nodes."""

    attempt: int
    nodes_back: list[int] = Field(default_factory=list)
    duration_s: float = 0.0


class Rewind(Entry):
    """The pointer got past the newest good checkpoint and was moved back to it (its ``from``
    step, a Python keyword, is kept as given)."""

    to: int | None = None
    quarantined: list[dict] = Field(default_factory=list)
    dropped: list[int] = Field(default_factory=list)


class VerdictRecord(Entry):
    """The validation gate's judgement of one checkpoint."""

    step: int
    path: str
    verdict: Literal["good", "bad"]
    problems: list[str] = Field(default_factory=list)
    probe: dict = Field(default_factory=dict)
    metrics: dict = Field(default_factory=dict)


class SpanKind(StrEnum):
    """What a timed span of the campaign (``spans`` of the ledger) was: the wall-time facts the
    goodput split (``pretrain.views.goodput``) reads besides the jobs' own streams."""

    RUN = "run"  # one run of the campaign flow, start to end
    DATA_PREPARATION = "data_preparation"
    NODE_CHECK = "node_check"  # provisioning the cluster: its checks and the node health check
    STAGE = "stage"  # a stage: training, validation, evaluation
    JOB = "job"  # one launch of a stage's job, from its start to its end (``attempt``)
    VALIDATION_EVAL = "validation_eval"  # the final checkpoint's validation and evaluation
    REGISTRATION = "registration"  # exporting the final model and registering it in MLflow


class Span(GivenKeys):
    """A timed span: ``end`` None while it runs, or if the process recording it died."""

    kind: SpanKind | str  # a kind this release does not know is kept and ignored
    start: float
    end: float | None = None
    stage: str | None = None
    attempt: int | None = None


class CheckpointRecord(BaseModel):
    """A checkpoint by step and location."""

    model_config = ConfigDict(extra="allow")

    step: int
    path: str


class StageRecord(BaseModel):
    """One stage of the campaign."""

    model_config = ConfigDict(extra="allow")

    status: StageStatus
    steps: StrictInt
    checkpoints: StrictStr  # where its checkpoints live (redacted)
    attempts: StrictInt  # job launches so far
    restarts: StrictInt  # in-job restarts, over all attempts
    failures: list[Failure]
    resumes: list[Resume]
    resizes: list[Resize] = Field(default_factory=list)
    rewinds: list[Rewind] = Field(default_factory=list)
    verdicts: list[VerdictRecord] = Field(default_factory=list)
    final_checkpoint: CheckpointRecord | None = None  # the good checkpoint at its last step, once trained
    good_checkpoint: CheckpointRecord | None = None  # the newest checkpoint judged good
    mlflow_run_id: str | None = None
    eval: dict | None = None  # the final evaluation's metrics and its ``step``

    def newest_good_step(self) -> int:
        return self.good_checkpoint.step if self.good_checkpoint else -1


class MlflowRecord(BaseModel):
    model_config = ConfigDict(extra="allow")

    tracking_uri: StrictStr  # redacted
    experiment: StrictStr
    parent_run_id: str | None = None
    # MLflow misses some of what the ledger and the jobs' files hold (it was away): the next sync
    # that finds it answering sends it (``tasks.mlflow_sync``). Written only while true.
    behind: StrictBool = False

    @model_serializer(mode="wrap")
    def _behind_only_while_true(self, handler) -> dict[str, Any]:
        out = handler(self)
        if not out.get("behind"):
            out.pop("behind", None)
        return out


class ClusterRecord(BaseModel):
    """The cluster as the node check found it."""

    model_config = ConfigDict(extra="allow")

    kind: str = ""
    nodes: int = 0
    workers_per_node: int = 0
    excluded: list[int] = Field(default_factory=list)
    health: list[dict] = Field(default_factory=list)  # one row per worker slot


class RunEnd(BaseModel):
    """How the last run of the campaign ended, if not completed."""

    model_config = ConfigDict(extra="allow")

    state: str
    cause: str = ""
    time: float | None = None
    flow_run: str | None = None
    # a pause also records ``stage`` (where it paused; absent: between stages) and ``step`` (the
    # stage's newest good checkpoint), as extra keys: the other ends' records stay as they were


class CampaignRecord(BaseModel):
    """The whole ledger."""

    model_config = ConfigDict(extra="allow")

    version: int = LEDGER_VERSION
    campaign: StrictStr
    campaign_id: StrictStr
    spec_hash: StrictStr
    created: float | None = None
    status: CampaignStatus
    invocations: StrictInt  # runs of the campaign flow
    data: DataRecord | None = None  # the data set the campaign trains on
    cluster: ClusterRecord | None = None
    mlflow: MlflowRecord
    storage_options: dict = Field(default_factory=dict)  # redacted
    stages: dict[str, StageRecord]
    flow_run: str | None = None  # the Prefect flow run working on it (last one)
    registered_model: dict | None = None
    # why the final model is not registered yet (MLflow away at the campaign's end); the next run registers it
    registration_pending: StrictStr | None = None
    end: RunEnd | None = None
    spans: list[Span] = Field(default_factory=list)  # timed spans (runs, stages, jobs, ...); none before this release
    # a ledger on shared storage (``checkpoint.state_uri``) counts its writes; the workdir keeps a
    # read-only copy of it naming where it is a copy of (``copy_of``). Neither is written while unset.
    revision: StrictInt = 0
    copy_of: StrictStr | None = None

    def interrupted(self, flow_run: str) -> bool:
        """The ledger records ``flow_run`` as interrupted by the operator."""
        return (
            self.flow_run == flow_run
            and self.end is not None
            and self.end.flow_run == flow_run
            and self.end.state == CampaignStatus.INTERRUPTED
        )

    def excluded_nodes(self) -> list[int]:
        return list(self.cluster.excluded) if self.cluster else []

    def node_health(self) -> list[dict]:
        return list(self.cluster.health) if self.cluster else []

    def to_json(self) -> dict:
        out = self.model_dump(mode="json")
        for key, unset in (("revision", 0), ("copy_of", None)):
            if out.get(key) == unset:
                out.pop(key, None)
        return out


def new_stage(steps: int, checkpoints: str) -> StageRecord:
    return StageRecord(
        status=StageStatus.PENDING,
        steps=steps,
        checkpoints=checkpoints,
        attempts=0,
        restarts=0,
        failures=[],
        resumes=[],
    )


def describe_problem(error: dict) -> str:
    """One pydantic error of a ledger, said in the file's terms."""
    loc, value = error["loc"], error.get("input")
    if loc[:1] == ("stages",) and len(loc) >= 2:
        stage = loc[1]
        if len(loc) == 2:
            return f"stage {stage!r} is not an object"
        if loc[2] == "verdicts" and len(loc) >= 4 and (len(loc) == 4 or loc[4] == "verdict"):
            return f"a 'verdict' of stage {stage!r} is not good or bad"
        what = f"{'.'.join(map(str, loc[2:]))!r} of stage {stage!r}"
    else:
        what = repr(".".join(map(str, loc)))
    if error["type"] == "missing":
        return f"{what} is missing"
    return f"{what} is {repr(value)[:60]} ({error['msg'].lower()})"
