"""Chaos drills: faults injected on purpose, so a team can rehearse recovery before a real
campaign (and so the tests and benchmarks can exercise it).

Each drill fires **once per stage**: a marker file created with O_EXCL in the stage's job
directory records it, so a restarted worker (or a relaunched job) does not fire it again.
Worker-side kinds: ``kill_worker``, ``hang_worker``, ``nan_loss``, ``loss_spike`` (the loss ×
``factor``), ``slow_worker`` (every step, no marker). Agent-side kinds (``trainer.launch``):
``kill_saver``, ``kill_node``. Saver-side kind: ``corrupt_checkpoint`` (one byte of the committed
model state flipped in storage: silent corruption that only the validation gate's sha256 check
can catch). Drills come typed per kind from the job (``trainer.job.config.Drill`` and subclasses),
with every value from the spec: none is defaulted here.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from trainer.job.config import Drill, NodeDrill, SlowWorkerDrill, WorkerDrill
from trainer.job.drills import claim, claimed, reached_marker
from trainer.job.events import EventKind

# who fires a drill follows from its type (trainer.job.config.DRILLS): workers fire WorkerDrills, the
# node's agent NodeDrills, the saver CorruptCheckpoint


class WorkerChaos:
    def __init__(self, drills: list[Drill], job_dir: str | Path, rank: int, report, node: int = 0, before_loss=None):
        """``before_loss(index, victim)``: called by every rank at a ``kill_worker`` / ``hang_worker``
        drill's step before it fires (waits for the victim's node's warm spare; ``index``: the
        drill's; ``victim``: whether this rank is the one the drill takes)."""
        self.drills: list[tuple[int, WorkerDrill]] = [
            (i, d) for i, d in enumerate(drills) if isinstance(d, WorkerDrill)
        ]
        self.agent_drills: list[tuple[int, NodeDrill]] = [
            (i, d) for i, d in enumerate(drills) if isinstance(d, NodeDrill) and d.node == node
        ]
        self.job_dir, self.rank, self.report = job_dir, rank, report
        self.before_loss = before_loss
        self._slowed: set[int] = set()

    def wait_for_agent_drills(self, step: int) -> None:
        """At an agent-side drill's step on this worker's node: wait until the agent has fired it
        (``kill_node``, ``freeze_node``: for good, the agent kills or stops this process)."""
        for i, d in self.agent_drills:
            if step >= d.step and not claimed(self.job_dir, i):
                reached_marker(self.job_dir, i).parent.mkdir(parents=True, exist_ok=True)
                reached_marker(self.job_dir, i).touch()
                while d.kind in ("kill_node", "freeze_node") or not claimed(self.job_dir, i):
                    threading.Event().wait(0.02)

    def _due(self, d: WorkerDrill, step: int) -> bool:
        return d.rank == self.rank and d.step == step

    def before_step(self, step: int) -> None:
        """Called before optimizer step ``step`` (1-based) is computed."""
        self.wait_for_agent_drills(step)
        for i, d in self.drills:
            if isinstance(d, SlowWorkerDrill) and d.rank == self.rank and step >= d.step:
                if i not in self._slowed:  # record that the slowdown is on (the node check after a restart reads it)
                    claim(self.job_dir, i)
                    self._slowed.add(i)
                time.sleep(d.delay_s)  # a straggler, on purpose
            elif d.kind in ("kill_worker", "hang_worker"):
                if d.step == step and self.before_loss is not None and not claimed(self.job_dir, i):
                    self.before_loss(i, d.rank == self.rank)  # every rank, so none waits in a collective meanwhile
                if not (self._due(d, step) and claim(self.job_dir, i)):
                    continue
                self.report({"event": EventKind.CHAOS, "kind": d.kind, "rank": self.rank, "step": step})
                if d.kind == "kill_worker":
                    os.kill(os.getpid(), signal.SIGKILL)
                threading.Event().wait()  # hang_worker: never returns; the hang detector must act

    def check_delay(self) -> float:
        """Extra seconds per matmul of this rank's node check after a restart: a ``slow_worker``
        drill slows the check too once it is active (from its ``step`` on, recorded by a marker)."""
        return sum(
            d.delay_s
            for i, d in self.drills
            if isinstance(d, SlowWorkerDrill) and d.rank == self.rank and (d.step <= 1 or claimed(self.job_dir, i))
        )

    def loss_factor(self, step: int) -> float:
        """What this rank's loss at ``step`` is multiplied by: NaN (``nan_loss``), ``factor``
        (``loss_spike``) or 1."""
        for i, d in self.drills:
            if d.kind in ("nan_loss", "loss_spike") and self._due(d, step) and claim(self.job_dir, i):
                self.report({"event": EventKind.CHAOS, "kind": d.kind, "rank": self.rank, "step": step})
                return float("nan") if d.kind == "nan_loss" else d.factor
        return 1.0
