"""The orchestrator's watch over one launched training job, until it ends.

While the job runs, its supervisor stops it with a save at breakpoint at an operator's stop
(``pretrain.run.stop``) or a due pause (``pretrain.run.budget``), records the nodes it loses, re-checks
lost nodes to scale the job back up, and keeps the stage's progress up to date."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.cluster.factory import make_cluster
from pretrain.cluster.local import recheck_nodes
from pretrain.run.budget import PauseRequest
from pretrain.run.jobs import threads_per_worker
from pretrain.run.stop import StopRequest
from pretrain.settings import PretrainSettings
from pretrain.spec.campaign import CampaignSpec
from pretrain.state.ledger import Ledger
from tasks.training_progress import StageProgress
from trainer.job.config import JobConfig
from trainer.job.events import EventKind
from trainer.job.layout import JobLayout
from trainer.job.reporting import JsonLines


@dataclass
class RejoinWatch:
    """When lost nodes are due for a re-check (``after_s`` after they were lost; 0: never)."""

    after_s: float
    since: dict[int, float] = field(default_factory=dict)

    def lost(self, node: int) -> None:
        self.since[node] = time.monotonic()

    def due(self) -> list[int]:
        now = time.monotonic()
        return sorted(n for n, t in self.since.items() if self.after_s and now - t >= self.after_s)


class JobSupervisor:
    """One launched job (``handle``) of a stage, polled until it exits. What it saw on the way is
    kept for the job's summary: ``interrupted`` (stopped by the operator), ``paused`` (why it was
    stopped to pause the campaign), ``scaled_up`` (lost nodes that passed a re-check), ``started``."""

    def __init__(
        self,
        spec: CampaignSpec,
        stage_index: int,
        attempt: int,
        job: JobConfig,
        handle,
        stop: StopRequest | None,
        pause: PauseRequest | None,
        logger,
        settings: PretrainSettings,
    ):
        self.spec, self.attempt, self.handle, self.logger, self.settings = spec, attempt, handle, logger, settings
        self.stop, self.pause = stop, pause
        self.stage, self.job_dir = job.stage.name, Path(job.job_dir)
        self.progress = StageProgress(spec, stage_index, attempt, logger, settings)
        self.started = time.time()
        self.rejoin = RejoinWatch(spec.cluster.rejoin_after_s)
        self.scaled_up: list[int] = []
        self.interrupted, self.paused = False, None
        self.code: int | None = None
        self.lost: dict[int, int | None] = {}
        self.events: JsonLines | None = None

    def until_end(self) -> int:
        """Poll the job until it exits, acting on what each poll finds; its exit code."""
        self.events = JsonLines(JobLayout(self.job_dir).events)
        while self.code is None:
            self.code = self.handle.wait(timeout=self.settings.job_poll_s)
            self._stop_if_requested()
            self._pause_if_due()
            self._note_lost_nodes()
            for notice in self.handle.new_notices():
                self.logger.warning("stage %s attempt %d: %s", self.stage, self.attempt, notice)
            self.progress.update()
            self._scale_up_if_due()
        # stopped as the job ended (a job of one node: its failure)
        for node in set(self.handle.silent) - set(self.lost):
            self.events.write(node_lost(self.handle, node, self.handle.lost_nodes().get(node), standby=False))
        stop = self.stop
        if self.code and not (self.interrupted or self.paused) and stop is not None and stop.requested.is_set():
            # killed at once by the operator's second signal before a pause began: no job failure
            self.interrupted = True
        return self.code

    def _stop_if_requested(self) -> None:
        """Not a failure: the operator's stop (under `pretrain run` a signal asks for the pause instead)."""
        stop = self.stop
        if stop is not None and stop.requested.is_set() and self.pause is None and self.code != 0:
            if self.code is None:
                self.logger.warning(
                    "stage %s: %s received; stopping the job (its savers save at breakpoint, up to %.0fs)",
                    self.stage,
                    stop.name,
                    self.settings.stop_grace_s,
                )
                self.handle.stop(grace_s=self.settings.stop_grace_s)
            self.interrupted, self.code = True, self.handle.poll()

    def _pause_if_due(self) -> None:
        if self.code is not None or self.pause is None:
            return
        self.paused = self.pause.due()
        if self.paused:
            self.logger.info(
                "stage %s: pausing the campaign: %s; stopping the job (its savers save at breakpoint, up to %.0fs)",
                self.stage,
                self.paused,
                self.settings.stop_grace_s,
            )
            self.handle.stop(grace_s=self.settings.stop_grace_s)
            self.code = self.handle.poll()

    def _note_lost_nodes(self) -> None:
        """Record each node that died while the others go on."""
        for node, exit_code in self.handle.lost_nodes().items() if self.code is None else ():
            if node in self.lost:
                continue
            self.lost[node] = exit_code
            replaced = len(self.lost) <= self.handle.spare_nodes  # a standby node takes its place: nothing to scale up
            if not replaced:
                self.rejoin.lost(node)
            self.logger.warning(
                "stage %s: node %d lost (exit %s); training continues %s",
                self.stage,
                node,
                exit_code,
                "with a standby node in its place" if replaced else "on the others",
            )
            self.events.write(node_lost(self.handle, node, exit_code, standby=replaced))

    def _scale_up_if_due(self) -> None:
        if self.code is None and (due := self.rejoin.due()):
            self.scaled_up = try_scale_up(
                self.spec, self.stage, due, self.rejoin, self.events, self.logger, self.settings
            )
            if self.scaled_up:
                self.handle.stop(grace_s=self.settings.scale_up_grace_s)  # the savers persist the newest snapshot
                self.code = self.handle.poll()


def try_scale_up(
    spec: CampaignSpec,
    stage: str,
    due: list[int],
    rejoin: RejoinWatch,
    events: JsonLines,
    logger,
    settings: PretrainSettings,
) -> list[int]:
    """Re-check lost nodes; the ones that pass make the job scale back up (returned). The ones
    that fail are checked again after another ``rejoin_after_s``."""
    baseline = Ledger.open(spec).record.node_health()
    fit, rows = recheck_nodes(
        make_cluster(spec.cluster, threads_per_worker(spec), settings=settings, campaign=spec),
        spec.workdir_path,
        due,
        baseline,
        spec.fault_tolerance.node_check_threshold,
    )
    for node in due:
        rejoin.lost(node)  # restart its clock: re-checked later if it did not pass now
    events.write({"event": EventKind.NODE_RECHECK, "nodes": due, "fit": fit, "rows": rows, "source": "orchestrator"})
    if fit:
        logger.info("stage %s: node(s) %s passed the health check again; stopping the job to scale back up", stage, fit)
    else:
        logger.warning(
            "stage %s: lost node(s) %s still fail the health check; training continues without them", stage, due
        )
    return fit


def node_lost(handle, node: int, exit_code: int | None, standby: bool) -> dict:
    """The orchestrator's record of a lost node (``standby``: a standby node takes its place), with
    how long it had been silent when the handle stopped it for that."""
    return {
        "event": EventKind.NODE_LOST,
        "node": node,
        "exit_code": exit_code,
        "standby": standby,
        "source": "orchestrator",
        **({"silent_s": handle.silent[node]} if node in handle.silent else {}),
    }
