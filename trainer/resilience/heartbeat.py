"""Worker heartbeats and the agent-side hang detector.

Every worker replaces ``<job_dir>/heartbeat/agent<agent pid>-local<local rank>.json`` with its
step and phase (``startup`` → ``step`` → ``checkpoint`` …) as it goes. The node agent checks its
own workers: one whose heartbeat is older than its phase's timeout is hung; the agent kills
it, so torch's elastic agent restarts the workers from the newest snapshot.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from trainer.events import EventKind
from trainer.process import pid_alive


def heartbeat_dir(job_dir: str | Path) -> Path:
    return Path(job_dir) / "heartbeat"


class Heartbeat:
    def __init__(self, job_dir: str | Path, local_rank: int, rank: int):
        d = heartbeat_dir(job_dir)
        d.mkdir(parents=True, exist_ok=True)
        self.path = d / f"agent{os.getppid()}-local{local_rank}.json"
        self.rank = rank

    def beat(self, phase: str, step: int) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"phase": phase, "step": step, "rank": self.rank, "pid": os.getpid(),
                                   "time": time.time()}))
        os.replace(tmp, self.path)  # readers never see half a record; no fsync needed




def worker_pids(job_dir: str | Path, agent_pid: int | None = None) -> list[int]:
    """Live worker pids of one node agent (default: the calling agent)."""
    pids = []
    for path in heartbeat_dir(job_dir).glob(f"agent{agent_pid or os.getpid()}-local*.json"):
        try:
            pid = json.loads(path.read_text())["pid"]
        except (OSError, ValueError):
            continue
        if pid_alive(pid):
            pids.append(pid)
    return pids


class HangDetector:
    """Runs in the node agent; ``on_event`` receives hang records (and may drive other drills)."""

    def __init__(self, job_dir: str | Path, timeouts: dict[str, float], on_event, interval: float = 0.5):
        self.dir, self.timeouts, self.on_event, self.interval = heartbeat_dir(job_dir), timeouts, on_event, interval
        self.prefix = f"agent{os.getpid()}-"
        self.stop = threading.Event()
        self.max_step = 0
        self.observers: list = []  # callables(step) run on each scan with the node's newest step

    def scan(self) -> None:
        """One pass: a hang usually stalls every rank (the others wait in a collective), so all
        stalled workers are reported as one hang and killed together."""
        now, stalled = time.time(), []
        for path in self.dir.glob(f"{self.prefix}local*.json"):
            try:
                hb = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if not pid_alive(hb["pid"]):
                continue  # an old worker's record; its replacement overwrites it
            self.max_step = max(self.max_step, hb["step"])
            limit = self.timeouts.get(hb["phase"])
            if limit and now - hb["time"] > limit:
                stalled.append(hb)
        if stalled:
            first = min(stalled, key=lambda hb: hb["time"])
            self.on_event({"event": EventKind.HANG, "ranks": sorted(hb["rank"] for hb in stalled), "phase": first["phase"],
                           "step": first["step"], "stalled_s": round(now - first["time"], 1)})
            for hb in stalled:
                try:
                    os.kill(hb["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for observe in self.observers:
            observe(self.max_step)

    def start(self) -> "HangDetector":
        def loop() -> None:
            while not self.stop.wait(self.interval):
                self.scan()

        threading.Thread(target=loop, name="hang-detector", daemon=True).start()
        return self
