"""The campaign ledger: a small JSON file in the workdir that says where the campaign stands.

It records what the orchestrator decided and observed (stages done, attempts, restarts,
failures with causes and time lost, MLflow run ids). Checkpoints themselves are the truth for
training progress; the ledger never claims a step that storage does not hold.

A campaign whose state is on shared storage (``checkpoint.state_uri``) keeps its ledger there;
its workdir holds a read-only copy, rewritten after each change (``copy_of`` names the original),
so that whatever reads a workdir (``pretrain status``, reports, pictures) reads that campaign too.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from pretrain.redact import redact, redact_tree
from pretrain.spec.campaign import CampaignSpec
from pretrain.spec.layout import CampaignLayout
from pretrain.state.guard import held, state_storage
from pretrain.state.local import LedgerDamaged, LedgerError, _parse, _prev, _read, _read_with_bytes
from pretrain.state.locations import checkpoint_location, storage_options
from pretrain.state.lock import updating
from pretrain.state.remote import RemoteLedger, keep_copy, refuse_foreign_workdir
from pretrain.state.schema import (
    CampaignRecord,
    CampaignStatus,
    CheckpointRecord,
    ClusterRecord,
    DataRecord,
    Failure,
    MlflowRecord,
    Resize,
    Resume,
    Rewind,
    Span,
    SpanKind,
    StageRecord,
    StageStatus,
    VerdictRecord,
    new_stage,
)
from trainer.common.atomic import atomic_write_bytes, atomic_write_json
from trainer.common.diskfull import describe, is_disk_full


class CampaignMismatch(RuntimeError):
    """The workdir belongs to a campaign with a different spec."""


class LedgerDiskFull(RuntimeError):
    """The ledger could not be written: its file system is full (the campaign fails, saying what
    to free; the file on disk is the previous, intact one)."""


def _parse_remote(where: str, data: bytes) -> CampaignRecord:
    """The ledger object's record; LedgerDamaged naming it and what to do."""
    try:
        return _parse(where, data)  # (it names ``where`` in its messages only)
    except LedgerDamaged as err:
        raise LedgerDamaged(
            f"{err}. Nothing but this campaign's runs should write it: make sure none is running, then delete it "
            "and run the campaign again with its spec (training resumes from its checkpoints; the ledger's history "
            "starts anew)"
        ) from None


def _remote(spec: CampaignSpec) -> RemoteLedger | None:
    """The ledger object of a campaign whose state is on shared storage (None: in the workdir);
    its writes are refused once this run's lease is lost."""
    if not spec.checkpoint.state_uri:
        return None
    mine = held(spec)
    return RemoteLedger(state_storage(spec), parse=_parse_remote, guard=mine.check if mine else None)


def ledger_location(spec: CampaignSpec) -> str | None:
    """Where the ledger of a campaign whose state is on shared storage is (None: its workdir)."""
    remote = _remote(spec)
    return remote.where if remote else None


@dataclass
class Ledger:
    """The campaign's ledger file and its last read content (``record``). Every change re-reads
    the file, applies itself and writes it back (:meth:`mutate`): several flows of one campaign
    each hold a Ledger, and none may overwrite the others' updates."""

    layout: CampaignLayout
    record: CampaignRecord
    remote: RemoteLedger | None = None  # the ledger object on shared storage (None: the workdir's file)

    @classmethod
    def read(cls, layout: CampaignLayout) -> Ledger | None:
        """The workdir's ledger; None if it has none; :class:`LedgerDamaged` if it cannot be read."""
        record = _read(layout.ledger)
        return None if record is None else cls(layout, record)

    @classmethod
    def of_spec(cls, spec: CampaignSpec) -> Ledger | None:
        """The campaign's ledger where its state lives (workdir, ``checkpoint.state_uri``); None: none yet."""
        return cls._load(spec, _remote(spec))

    @classmethod
    def _load(cls, spec: CampaignSpec, remote: RemoteLedger | None) -> Ledger | None:
        layout = spec.layout
        if remote is None:
            return cls.read(layout)
        record = remote.load()
        if record is None:
            return None
        ledger = cls(layout, record, remote)
        keep_copy(layout.ledger, record, remote.where)
        return ledger

    @classmethod
    def open(cls, spec: CampaignSpec) -> Ledger:
        """The campaign's ledger, created on first use; refuses a workdir of another spec."""
        layout, remote = spec.layout, _remote(spec)
        if remote is not None:
            refuse_foreign_workdir(layout.ledger, remote.where)
        ledger = cls._load(spec, remote)
        if ledger is None:
            ledger = cls(
                layout,
                CampaignRecord(
                    campaign=spec.name,
                    campaign_id=uuid.uuid4().hex,
                    spec_hash=spec.spec_hash(),
                    created=time.time(),
                    status=CampaignStatus.NEW,
                    invocations=0,
                    mlflow=MlflowRecord(tracking_uri=redact(spec.tracking_uri), experiment=spec.tracking.experiment),
                    storage_options=redact_tree(storage_options(spec)),
                    stages={s.name: new_stage(s.steps, redact(checkpoint_location(spec, s.name))) for s in spec.stages},
                ),
                remote,
            )
        else:
            ledger.refuse_other_spec(spec)
        return ledger

    def refuse_other_spec(self, spec: CampaignSpec) -> None:
        """:class:`CampaignMismatch` if this ledger's campaign was started from another spec."""
        if self.record.spec_hash == spec.spec_hash():
            return
        where, fresh = (
            (self.remote.where, "an unused `checkpoint.state_uri`")
            if self.remote
            else (self.layout.root, "--workdir pointing to an empty directory")
        )
        raise CampaignMismatch(
            f"{where} holds campaign {self.record.campaign!r} with spec hash {self.record.spec_hash}, "
            f"but this spec hashes to {spec.spec_hash()}: resume it with its original spec, "
            f"or start a new campaign with {fresh}"
        )

    def save(self) -> None:
        """Write the ledger atomically, first keeping the current (intact) one as ``ledger.json.prev``
        (on shared storage: replace the stored record with this one, conditionally)."""
        if self.remote is not None:
            mine = self.record

            def overwrite(r: CampaignRecord) -> None:
                for name in type(mine).model_fields:
                    setattr(r, name, getattr(mine.model_copy(deep=True), name))

            self.record = self.remote.update(overwrite, mine)
            keep_copy(self.layout.ledger, self.record, self.remote.where)
            return
        path = self.layout.ledger
        try:
            current = path.read_bytes()
            _parse(path, current)
        except (FileNotFoundError, LedgerError):
            current = None  # .prev keeps the last intact generation
        self._write(current)

    def _write(self, current: bytes | None) -> None:
        """Keep ``current`` (the intact file's bytes, None: none) as ``.prev``, then write the record;
        never over the workdir's read-only copy of a ledger on shared storage."""
        path = self.layout.ledger
        if self.record.copy_of:
            raise LedgerError(
                f"{path} is a read-only copy of the campaign's ledger {self.record.copy_of}: "
                "run the campaign with its spec (its `checkpoint.state_uri`) to change it"
            )
        try:
            if current is not None:
                atomic_write_bytes(_prev(path), current)
            atomic_write_json(path, self.record.to_json(), sort_keys=False)  # stages stay in order
        except OSError as e:
            if not is_disk_full(e):
                raise
            need = 2 * len(json.dumps(self.record.to_json(), indent=2)) + (len(current) if current else 0)
            raise LedgerDiskFull(
                describe(
                    path.parent,
                    need,
                    "the campaign ledger",
                    f"{path.name} on disk is the previous version, intact. Free space there (older checkpoints: lower "
                    "`checkpoint.keep`; old jobs/ logs), then run the same command again.",
                )
            ) from None

    def reload(self) -> CampaignRecord:
        fresh = self.remote.load() if self.remote is not None else _read(self.layout.ledger)
        if fresh is not None:
            self.record = fresh
        return self.record

    def mutate(self, change: Callable[[CampaignRecord], object]) -> CampaignRecord:
        """Re-read the file, apply ``change(record)``, write it back if it changed (the bytes read,
        which were just validated, become ``.prev``)."""
        if self.remote is not None:  # conditional writes: a lost race re-reads and re-applies ``change``
            self.record = self.remote.update(change, self.record)
            keep_copy(self.layout.ledger, self.record, self.remote.where)
            return self.record
        with updating(self.layout.ledger):
            read = _read_with_bytes(self.layout.ledger)
            current = None
            if read is not None:
                current, self.record = read
            before = self.record.model_copy(deep=True)
            change(self.record)
            if read is None or self.record != before:  # a change that changes nothing writes nothing
                self._write(current)
        return self.record

    def stage(self, name: str) -> StageRecord:
        """The stage as last read (:meth:`reload` for the file's current state)."""
        return self.record.stages[name]

    def _change_stage(self, name: str, change: Callable[[StageRecord], object]) -> StageRecord:
        return self.mutate(lambda r: change(r.stages[name])).stages[name]

    # the campaign
    def begin_run(self, flow_run: str, spec: CampaignSpec | None = None) -> None:
        """A run of the campaign flow starts working on it (from ``spec``'s workdir: a campaign moved
        or copied elsewhere records where its stages' checkpoints are now)."""

        def change(r: CampaignRecord) -> None:
            r.status, r.invocations, r.flow_run = CampaignStatus.RUNNING, r.invocations + 1, flow_run
            for name, stage in r.stages.items() if spec is not None else ():
                old, new = stage.checkpoints, redact(checkpoint_location(spec, name))
                for ref in (stage.good_checkpoint, stage.final_checkpoint):
                    if ref is not None and old != new and ref.path.startswith(old + "/"):
                        ref.path = new + ref.path[len(old) :]
                stage.checkpoints = new

        self.mutate(change)

    def set_status(self, status: CampaignStatus) -> None:
        self.mutate(lambda r: setattr(r, "status", status))

    def set_parent_run(self, run_id: str) -> None:
        self.mutate(lambda r: setattr(r.mlflow, "parent_run_id", run_id))

    def set_mlflow_behind(self, behind: bool) -> None:  # MLflow lacks some of what the workdir holds
        self.mutate(lambda r: setattr(r.mlflow, "behind", behind))

    def set_data(self, data: DataRecord) -> None:
        self.mutate(lambda r: setattr(r, "data", data))

    def set_cluster(self, cluster: ClusterRecord) -> None:
        self.mutate(lambda r: setattr(r, "cluster", cluster))

    def set_registered_model(self, registered: dict) -> None:
        def registered_now(r: CampaignRecord) -> None:
            r.registered_model, r.registration_pending = registered, None

        self.mutate(registered_now)

    def set_registration_pending(self, why: str) -> None:
        self.mutate(lambda r: setattr(r, "registration_pending", why))

    @contextmanager
    def timed(
        self, kind: SpanKind, stage: str | None = None, attempt: int | None = None, resume: bool = False
    ) -> Iterator[None]:
        """Record a span of wall time (``spans``): its start now, its end when the block exits,
        however it exits (when the block failed, a ledger that cannot be written leaves the span
        open and the block's error goes on). The goodput split reads these. ``resume``: continue
        the newest open span of this kind, stage and attempt if there is one (an adopted job:
        its span runs from its launch by the flow process that died)."""
        span = Span(
            kind=kind,
            start=time.time(),
            **({"stage": stage} if stage else {}),
            **({"attempt": attempt} if attempt is not None else {}),
        )
        found: list[tuple[int, Span]] = []

        def begin(r: CampaignRecord) -> None:
            found[:] = [
                (i, s)
                for i, s in enumerate(r.spans)
                if resume and s.end is None and s.kind == kind and s.stage == stage and s.attempt == attempt
            ][-1:] or []
            if not found:
                r.spans.append(span)
                found.append((len(r.spans) - 1, span))

        self.mutate(begin)
        index, span = found[0]

        def close(r: CampaignRecord) -> None:
            if index < len(r.spans) and r.spans[index].start == span.start:
                r.spans[index].end = time.time()

        try:
            yield
        except BaseException:
            with suppress(Exception):  # the block's error is the one to report; the span stays open
                self.mutate(close)
            raise
        self.mutate(close)

    # a stage
    def set_stage_status(
        self, stage: str, status: StageStatus, final_checkpoint: CheckpointRecord | None = None
    ) -> StageRecord:
        def change(s: StageRecord) -> None:
            s.status = status
            if final_checkpoint is not None:
                s.final_checkpoint = final_checkpoint

        return self._change_stage(stage, change)

    def set_stage_run(self, stage: str, run_id: str) -> None:
        self._change_stage(stage, lambda s: setattr(s, "mlflow_run_id", run_id))

    def set_eval(self, stage: str, evaluation: dict) -> None:
        self._change_stage(stage, lambda s: setattr(s, "eval", evaluation))

    def start_attempt(self, stage: str) -> int:
        """Count a launch of the stage's job; returns its attempt number (0 for the first)."""
        return self._change_stage(stage, lambda s: setattr(s, "attempts", s.attempts + 1)).attempts - 1

    def add_restarts(self, stage: str, restarts: int) -> None:
        self._change_stage(stage, lambda s: setattr(s, "restarts", s.restarts + restarts))

    def record_failure(self, stage: str, failure: Failure) -> None:
        self._change_stage(stage, lambda s: s.failures.append(failure.stamped()))

    def record_relaunch_recovery(self, stage: str, attempt: int, resumed_at: float | None) -> None:
        """The relaunch after job ``attempt``'s failure is done: training stepped again at
        ``resumed_at``. That failure's ``recovery_s`` (its job's end until then: the relaunch,
        rendezvous and restore) joins its ``time_lost_s``."""

        def change(s: StageRecord) -> None:
            for f in s.failures:
                if (
                    f.attempt == attempt
                    and not f.in_job
                    and f.detected_at is not None
                    and f.recovery_s is None
                    and resumed_at is not None
                ):
                    f.recovery_s = round(max(0.0, resumed_at - f.detected_at), 2)
                    f.time_lost_s = round(f.time_lost_s + f.recovery_s, 2)

        self._change_stage(stage, change)

    def record_resume(self, stage: str, resume: Resume) -> None:
        self._change_stage(stage, lambda s: s.resumes.append(resume.stamped()))

    def record_resize(self, stage: str, resize: Resize) -> None:
        self._change_stage(stage, lambda s: s.resizes.append(resize.stamped()))

    def record_rewind(self, stage: str, rewind: Rewind) -> None:
        self._change_stage(stage, lambda s: s.rewinds.append(rewind.stamped()))

    def record_verdict(self, stage: str, verdict: VerdictRecord) -> None:
        """Add the gate's verdict; a good one newer than the stage's good checkpoint becomes it."""

        def change(s: StageRecord) -> None:
            s.verdicts.append(verdict.stamped())
            if verdict.verdict == "good" and s.newest_good_step() < verdict.step:
                s.good_checkpoint = CheckpointRecord(step=verdict.step, path=verdict.path)

        self._change_stage(stage, change)
