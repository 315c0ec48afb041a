"""The ``fault_tolerance`` section of a campaign spec (what counts as hung, a loss anomaly or a
failed saver, and how a job recovers) and the ``resume`` section (how often a stage is relaunched,
and how long a stopped campaign has to pause)."""

from __future__ import annotations

from pydantic import Field

from pretrain.spec.base import Section


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
        "recent step durations (never above `step_timeout_s`, never below `hang_timeout_floor_s`), so a hang is found "
        "in seconds; 0: `step_timeout_s` only.",
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
        "ranks hold, in well under a second); false: restart the job's workers, which restore it "
        "on start-up (seconds).",
    )
    node_check_threshold: float = Field(
        2.0, gt=1, description="A node whose health check is slower than this multiple of the median is excluded."
    )
    saver_max_failures: int = Field(
        5,
        ge=1,
        description="A node's checkpoint saver that fails this many times in a row (restarted with a backoff "
        "doubling from `saver_backoff_s` up to 60 s; training goes on on its memory snapshots meanwhile) fails the job "
        "with the saver's error.",
    )
    fast_recovery_timeout_s: float = Field(
        30.0,
        ge=0,
        description="When a worker of a DDP job over gloo dies, the others (on every node) are kept and a spare (one "
        "node) or a replacement its node's agent starts takes its rank (docs/recovery.md); if they are not all "
        "restored in a new process group within this many seconds, every worker is restarted instead (the full "
        "restart). 0: always the full restart.",
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
        "while a job trains: its savers are restarted meanwhile without counting toward `saver_max_failures`, training "
        "goes on on memory snapshots, and the newest one is persisted once the storage answers; unreachable longer, "
        "the job fails with the storage's error.",
    )
