"""Follow a campaign from its workdir alone (ledger, lock file, the running job's files): what
``pretrain run`` draws while it trains and what ``pretrain status --watch`` shows from another
terminal. Reads only; never takes the campaign's lock."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.console_progress import ProgressDisplay
from pretrain.spec.layout import CampaignLayout
from pretrain.state.ledger import Ledger
from pretrain.state.lock import read_holder
from pretrain.state.schema import CampaignRecord, CampaignStatus, StageStatus
from pretrain.views.training_progress import TrainingSnapshot, TrainingWatch, job_watch
from trainer.common.process import pid_alive

TITLE = "training"


def holder_alive(holder: dict) -> bool:
    """Whether the process the lock file names may still run: False only when it is on this host
    and gone (a campaign killed without a chance to record its end leaves "running" behind)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or holder.get("host") != socket.gethostname():
        return True
    return pid_alive(pid)


def running(record: CampaignRecord, workdir: Path) -> bool:
    """The ledger says running and its runner is not known to be gone."""
    return record.status == CampaignStatus.RUNNING and holder_alive(read_holder(workdir))


@dataclass
class CampaignFollower:
    """Where the campaign in ``workdir`` trains now: the stage whose job runs, and its numbers."""

    workdir: Path
    watch: TrainingWatch | None = None  # the running stage's, or the last one's
    record: CampaignRecord | None = None
    ended: bool = False  # the watched stage ended and was shown once more

    def look(self) -> TrainingSnapshot | None:
        """The running stage's snapshot, and once more the stage's after it ended; None while no
        stage trains (data, node check, evaluation). Raises ``LedgerError`` for a damaged ledger."""
        layout = CampaignLayout(self.workdir)
        ledger = Ledger.read(layout)
        self.record = ledger.record if ledger else None
        if self.record is None:
            return None
        stage = next(
            (name for name, s in self.record.stages.items() if s.status == StageStatus.RUNNING and s.attempts > 0), None
        )
        if stage is None:
            if self.watch is None or self.ended:
                return None
            self.ended = True  # the stage just ended: once more, with its final record (the last
            return self.watch.poll(final=True)  # checkpoint's verdict, the restarts)
        self.ended = False
        s = self.record.stages[stage]
        if self.watch is None or (self.watch.stage, self.watch.attempt) != (stage, s.attempts - 1):
            self.watch = job_watch(self.workdir, stage, s.attempts - 1, s.steps, lambda: self._stage(stage))
        return self.watch.poll()

    def _stage(self, name: str):
        return self.record.stages.get(name) if self.record else None

    def running(self) -> bool:
        return self.record is not None and running(self.record, self.workdir)


def show(display: ProgressDisplay, snap: TrainingSnapshot) -> None:
    stage = f"stage {snap.stage}" + (f" (attempt {snap.attempt + 1})" if snap.attempt else "")
    display.update(snap.done, snap.total, stage, **snap.fields())


@dataclass
class FollowThread:
    """``pretrain run``'s display: a thread that looks at the workdir every ``every_s`` while the
    flow runs in this process, and draws the running stage's snapshots."""

    workdir: Path
    display: ProgressDisplay
    every_s: float = 1.0
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    follower: CampaignFollower = field(init=False)

    def __post_init__(self) -> None:
        self.follower = CampaignFollower(self.workdir)

    def start(self) -> FollowThread:
        self.thread = threading.Thread(target=self._run, name="training-progress", daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            self._look()

    def _look(self) -> None:
        try:
            snap = self.follower.look()
        except Exception:  # noqa: BLE001 - a ledger mid-replace or damaged: the run itself reports it
            return
        if snap is not None and snap.step >= 0:
            show(self.display, snap)

    def close(self) -> None:
        """Stop, take a last look (a stage that ended since the last one shows its end), close."""
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
            if not self.thread.is_alive():
                self._look()
        self.display.close()
