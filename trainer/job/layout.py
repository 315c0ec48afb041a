"""Where a job keeps each of its files: every name under a job's directory
(``<workdir>/jobs/<stage>/attempt_NNN/``) and the stage's directory above it, in one place. The
orchestrator reads the same files through this class (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

EVENTS = "events.jsonl"
METRICS = "metrics.jsonl"


@dataclass(frozen=True)
class JobLayout:
    root: Path  # the job's directory: one attempt of one stage

    @classmethod
    def of(cls, job_dir: str | Path) -> JobLayout:
        return cls(Path(job_dir))

    # ---- the job's own files -------------------------------------------------------------------
    @property
    def config(self) -> Path:
        """``job.json``: the job's config, written by the orchestrator before it starts (trainer.job.config)."""
        return self.root / "job.json"

    @property
    def events(self) -> Path:
        """``events.jsonl``: every rank's and agent's events (trainer.job.events), one JSON line each."""
        return self.root / EVENTS

    @property
    def metrics(self) -> Path:
        """``metrics.jsonl``: rank 0's line per logged step."""
        return self.root / METRICS

    def node_log(self, node: int) -> Path:
        """A node's agent, saver and workers' output."""
        return self.root / f"node{node}.log"

    @property
    def heartbeats(self) -> Path:
        """One file per agent that the hang detector and the orchestrator read."""
        return self.root / "heartbeat"

    def liveness(self, node: int) -> Path:
        """A node agent's sign of life (trainer.liveness)."""
        return self.root / "nodes" / f"node{node}.json"

    @property
    def stacks(self) -> Path:
        """Hung workers' thread stacks, one file per dump (trainer.resilience.stacks)."""
        return self.root / "stacks"

    def exclusion_marker(self, node: int) -> Path:
        """Left by a node's workers when the node check after a restart excludes it; its agent stops it."""
        return self.root / f"exclude_node_{node}"

    # ---- the stage's files, shared by its attempts ---------------------------------------------
    @property
    def stage_dir(self) -> Path:
        return self.root.parent

    @property
    def skips(self) -> Path:
        """``skips.json``: sample windows skipped after loss anomalies (trainer.resilience.anomaly)."""
        return self.stage_dir / "skips.json"

    @property
    def chaos(self) -> Path:
        """Markers of the chaos drills that fired in this stage (trainer.job.drills)."""
        return self.stage_dir / "chaos"
