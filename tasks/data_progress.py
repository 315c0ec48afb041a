"""Data preparation's progress as a Prefect progress artifact (the UI's bar on the flow run).

Fed by the same :class:`~pretrain.data.prepare.progress.PrepProgress` snapshots as the console. Updates
are throttled (an API call per finished unit would be thousands), and the artifact is a side
channel: if the API refuses or is away, preparation goes on and this says so once in the log.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from uuid import UUID

from prefect.artifacts import create_progress_artifact, update_progress_artifact

from pretrain.console_progress import human
from pretrain.data.prepare.progress import PrepProgress, ProgressCallback
from tasks.artifacts import artifact_key

MIN_INTERVAL_S = 2.0  # between two updates of the artifact, except at phase changes


def progress_description(p: PrepProgress) -> str:
    """What the artifact's description says, in markdown."""
    text = f"Data preparation: **{p.phase}**"
    if p.units_total:
        text += f", {p.units_done}/{p.units_total} units"
    if p.bytes_total:
        text += f", {human(p.bytes_done, 'B')} of {human(p.bytes_total, 'B')}"
    return text + f"; {human(p.tokens)} tokens, {human(p.documents)} documents"


@dataclass
class PrepArtifact:
    """A ``ProgressCallback`` that keeps the campaign's ``data-preparation-<campaign>`` progress
    artifact up to date (make it with :meth:`for_campaign`)."""

    key: str
    log: Callable[[str], None]
    min_interval_s: float = MIN_INTERVAL_S
    clock: Callable[[], float] = time.monotonic
    artifact_id: UUID | None = None
    failed: bool = False  # the API refused once: no more tries in this run
    last: tuple[float, str] | None = field(default=None, repr=False)  # (time, phase) of the last update

    @classmethod
    def for_campaign(cls, campaign: str, log: Callable[[str], None]) -> PrepArtifact:
        return cls(artifact_key("data-preparation", campaign), log)

    def __call__(self, p: PrepProgress) -> None:
        now = self.clock()
        if self.failed or (self.last and p.phase == self.last[1] and now - self.last[0] < self.min_interval_s):
            return
        self.last = (now, p.phase)
        percent, description = round(100 * p.fraction, 1), progress_description(p)
        try:
            if self.artifact_id is None:
                self.artifact_id = create_progress_artifact(percent, key=self.key, description=description)
            else:
                update_progress_artifact(self.artifact_id, percent, description=description)
        except Exception as e:  # noqa: BLE001 - a side channel: never stops preparation
            self.failed = True
            self.log(
                f"cannot publish data preparation progress to Prefect ({type(e).__name__}: {e}); preparation goes on"
            )


def fan_out(*callbacks: ProgressCallback | None) -> ProgressCallback:
    """One callback calling each given one in turn."""
    chosen = [c for c in callbacks if c is not None]

    def call(p: PrepProgress) -> None:
        for c in chosen:
            c(p)

    return call
