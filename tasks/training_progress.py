"""A training stage's progress, published while its job runs: a line in the flow run's log every
``progress_interval_s`` (step / total, loss, tokens/s, ETA, restarts, newest checkpoint and its
verdict) and the campaign's ``training-progress-<campaign>`` Prefect progress artifact (percent of
all stages' steps, the same line as its description).

A side channel: an API that refuses or a ledger that cannot be read never stops training; a
refused artifact is said once in the log and not tried again in this job.
"""

from __future__ import annotations

from uuid import UUID

from prefect.artifacts import create_progress_artifact, update_progress_artifact

from pretrain.settings import PretrainSettings
from pretrain.spec.campaign import CampaignSpec
from pretrain.spec.layout import CampaignLayout
from pretrain.state.ledger import Ledger
from pretrain.state.schema import StageRecord
from pretrain.views.training_progress import Throttle, TrainingSnapshot, job_watch, progress_extra
from tasks.artifacts import artifact_key

ARTIFACT_INTERVAL_S = 2.0  # between two updates of the artifact (the UI's bar)


class StageProgress:
    """Follows one attempt of a stage's job for the flow run's log and the progress artifact."""

    def __init__(self, spec: CampaignSpec, stage_index: int, attempt: int, logger, settings: PretrainSettings):
        stage = spec.stages[stage_index]
        self.logger, self._campaign = logger, spec.name
        self.campaign_total = sum(s.steps for s in spec.stages)
        self.offset = spec.step_offset(stage_index)
        layout = spec.layout
        self.watch = job_watch(
            spec.workdir_path, stage.name, attempt, stage.steps, lambda: _stage_record(layout, stage.name)
        )
        self.log_due = Throttle(settings.progress_interval_s)
        self.artifact_due = Throttle(ARTIFACT_INTERVAL_S)
        self.log_due.due()  # the first line after one interval: "launching" was just logged
        self.last_logged: tuple | None = None
        self.artifact: UUID | None = None
        self.artifact_failed = False
        self._publish(self.watch.poll(), create=True)

    def update(self, final: bool = False) -> TrainingSnapshot | None:
        """Look at the job when a line or an artifact update is due (``final``: the job ended)."""
        log, publish = final or self.log_due.due(), final or self.artifact_due.due()
        if not (log or publish):
            return None
        snap = self.watch.poll(final)
        for note in self.watch.take_notes():  # each recovery as it happens (not a progress line: consoles keep it)
            self.logger.warning("stage %s: %s", snap.stage, note)
        if publish:
            self._publish(snap)
        key = (snap.step, snap.checkpoint_step, snap.checkpoint_verdict, snap.restarts)
        if log and snap.step >= 0 and key != self.last_logged:  # nothing new: no line
            self.logger.info("%s", snap.line(), extra=progress_extra())
            self.last_logged = key
        return snap

    def _publish(self, snap: TrainingSnapshot, create: bool = False) -> None:
        if self.artifact_failed or (not create and self.artifact is None):
            return
        percent = round(100.0 * (self.offset + snap.done) / self.campaign_total, 1) if self.campaign_total else 0.0
        description = f"{snap.line()}; campaign {self.offset + snap.done}/{self.campaign_total} steps"
        try:
            if create:
                self.artifact = create_progress_artifact(
                    progress=percent, key=artifact_key("training-progress", self._campaign), description=description
                )
            else:
                update_progress_artifact(self.artifact, percent, description=description)
        except Exception as err:  # noqa: BLE001 - progress display must never stop training
            self.artifact_failed = True
            self.logger.warning(
                "cannot publish training progress to Prefect (%s: %s); training goes on", type(err).__name__, err
            )


def _stage_record(layout: CampaignLayout, stage: str) -> StageRecord | None:
    ledger = Ledger.read(layout)
    return ledger.record.stages.get(stage) if ledger else None
