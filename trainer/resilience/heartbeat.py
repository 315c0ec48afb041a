"""Worker heartbeats and the agent-side hang detector.

Every worker replaces ``<job_dir>/heartbeat/agent<agent pid>-local<local rank>.json`` with its
step and phase (``startup`` → ``step`` → ``checkpoint`` …) as it goes, and what it has observed
of its recent step durations (how many, their p99). The node agent checks its own workers: one
whose heartbeat is older than its phase's timeout is hung; the agent kills it, so torch's
elastic agent restarts the workers from the newest snapshot. The spec's timeouts are upper
bounds: once a worker has observed enough steps, its step timeout is ``max(floor, k × p99)`` of
its recent step durations (as nvidia-resiliency-ext derives its timeouts), so a hang in a job
of 50 ms steps is found in seconds, not after ``step_timeout_s``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from trainer.common.process import pid_alive, signal_process
from trainer.job.events import EventKind
from trainer.job.layout import JobLayout
from trainer.resilience.stacks import hung_stacks


def heartbeat_dir(job_dir: str | Path) -> Path:
    return JobLayout.of(job_dir).heartbeats


ADAPTED_PHASES = (
    "step",
)  # a checkpoint's duration is bimodal (memory copy / final commit to storage): fixed bound only
RECENT = 100  # step durations a worker's p99 is taken over
FLUSH_S = 0.05  # the most a heartbeat file lags the worker's newest beat


def p99(values) -> float:
    """The 99th percentile (nearest rank) of a non-empty collection."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


@dataclass(frozen=True)
class AdaptiveTimeout:
    """How a phase's hang timeout follows the job's observed durations (spec: fault_tolerance)."""

    factor: float  # timeout = factor × p99 of the recent durations; 0: the fixed timeouts only
    floor_s: float  # never below this, so a burst of fast steps cannot make a normal hiccup a hang
    warmup: int  # durations a worker must have observed before its timeout adapts

    def limit(self, upper: float, observed: int, p99_s: float) -> float:
        """The timeout for a phase whose spec bound is ``upper`` after ``observed`` durations of p99 ``p99_s``."""
        if self.factor <= 0 or observed < self.warmup:
            return upper
        return min(upper, max(self.floor_s, self.factor * p99_s))


FIXED = AdaptiveTimeout(0.0, 0.0, 0)
COLLECTIVE_MARGIN_S = 60.0


def collective_timeout_s(hang_timeouts: dict[str, float]) -> float:
    """The process group's timeout: longer than every phase's hang timeout, so a stalled
    collective is found (and recorded) as a hang by the detector, not ended first by the group's
    own timeout as an anonymous worker failure."""
    return max(hang_timeouts.values(), default=0.0) + COLLECTIVE_MARGIN_S


AGENT_ENV = (
    "PRETRAIN_AGENT_PID"  # set by our own node agent: its process id (a worker forked by the zygote is not its child)
)


def agent_pid() -> int:
    """The process id of this worker's node agent: ``PRETRAIN_AGENT_PID``, else the parent
    (torch's elastic agent runs in the node agent's process and starts the workers itself)."""
    try:
        return int(os.environ[AGENT_ENV])
    except (KeyError, ValueError):
        return os.getppid()


class Heartbeat:
    """A worker's heartbeat file. ``beat`` only records the beat in memory (a step beats three
    times: writing the file each time cost ~0.2 ms a beat, ~1 % of a 50 ms step); a writer thread
    replaces the file with the newest record at most every ``flush_s``. The record carries the
    time of the beat itself, so a file that lags by ``flush_s`` never makes a worker look fresher
    than it is (the hang timeouts are seconds). The first record is written at once: the agent
    finds its workers by their files."""

    def __init__(self, job_dir: str | Path, local_rank: int, rank: int, flush_s: float = FLUSH_S):
        d = heartbeat_dir(job_dir)
        d.mkdir(parents=True, exist_ok=True)
        self.path = d / f"agent{agent_pid()}-local{local_rank}.json"
        self.rank, self.flush_s = rank, flush_s
        self.durations: dict[str, deque[float]] = {p: deque(maxlen=RECENT) for p in ADAPTED_PHASES}
        self.last: tuple[str, int, float] | None = None  # phase, step, monotonic time of the previous beat
        self._observed: dict[str, list] = {}  # phase → [durations observed, their p99]
        self._record: dict | None = None
        self._version = self._written = 0  # beats recorded / the newest one in the file
        self._changed = threading.Condition()
        self._io = threading.Lock()  # one writer of the file at a time (the thread, or flush())
        self._writer: threading.Thread | None = None

    def beat(self, phase: str, step: int, collective: bool = False) -> None:
        """``collective``: from now on this rank may wait for its peers (the step's collectives);
        beating the same phase and step again refreshes the record, the phase's duration runs on."""
        now = time.monotonic()
        same = self.last is not None and (phase, step) == self.last[:2]
        if self.last is not None and self.last[0] in self.durations and not same:
            self.durations[self.last[0]].append(now - self.last[2])
            self._observed = {p: [len(d), p99(d)] for p, d in self.durations.items() if d}
        if not same:
            self.last = (phase, step, now)
        record = {
            "phase": phase,
            "step": step,
            "rank": self.rank,
            "pid": os.getpid(),
            "time": time.time(),
            "observed": self._observed,
            "collective": collective,
        }
        with self._changed:
            self._record, self._version = record, self._version + 1
            self._changed.notify()
        if self._writer is None:
            self.flush()
            self._writer = threading.Thread(target=self._write_changes, name="heartbeat-writer", daemon=True)
            self._writer.start()

    def flush(self) -> None:
        """Write the newest record now, if the file does not hold it yet."""
        with self._io:
            with self._changed:
                record, version = self._record, self._version
            if record is None or version == self._written:
                return
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path)  # readers never see half a record; no fsync needed
            self._written = version

    def _write_changes(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._version != self._written)
            self.flush()
            time.sleep(self.flush_s)  # the beats of the next flush_s go out as one write


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

    def __init__(
        self,
        job_dir: str | Path,
        timeouts: dict[str, float],
        on_event,
        interval: float = 0.5,
        adaptive: AdaptiveTimeout = FIXED,
        remote_grace_s: float = 0.0,
    ):
        # remote_grace_s: the node's workers have peers on other nodes, whose hang this node cannot
        # see; when all of its workers wait in a collective, they are taken for hung only this much
        # later than their timeout, so that the node of a hung peer kills it first (its death then
        # fails the collective, and the workers waiting here are kept as survivors)
        self.dir, self.timeouts, self.on_event, self.interval = heartbeat_dir(job_dir), timeouts, on_event, interval
        self.job_dir = job_dir
        self.adaptive, self.remote_grace_s = adaptive, remote_grace_s
        self.prefix = f"agent{os.getpid()}-"
        self.stop = threading.Event()
        self.max_step = 0
        self.observers: list = []  # callables(step) run on each scan with the node's newest step

    def scan(self) -> None:
        """One pass: a hang usually stalls every rank (the others wait in a collective). The
        stalled ranks that are *not* waiting in a collective are the hung ones: they alone are
        killed, and the ranks waiting for them are kept (their collective then fails, and they
        rejoin with the lost ranks' replacements: ``trainer.resilience.peers``). If every rank
        waits in a collective, the collective itself hangs: all are killed together (on a job of
        several nodes, ``remote_grace_s`` later)."""
        now, stalled, live, paths = time.time(), [], [], {}
        for path in self.dir.glob(f"{self.prefix}local*.json"):
            try:
                hb = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if not pid_alive(hb["pid"]):
                continue  # an old worker's record; its replacement overwrites it
            live.append(hb["rank"])
            paths[hb["pid"]] = path
            self.max_step = max(self.max_step, hb["step"])
            limit = self.limit(hb)
            if limit and now - hb["time"] > limit:
                stalled.append({**hb, "timeout_s": limit})
        waiting = [hb for hb in stalled if now - hb["time"] > hb["timeout_s"] + self.remote_grace_s]
        hung = [hb for hb in stalled if not hb.get("collective")] or (waiting if len(waiting) == len(live) else [])
        if hung:
            first = min(hung, key=lambda hb: hb["time"])
            kept = sorted(set(live) - {hb["rank"] for hb in hung})  # the node's other workers, not killed
            stacks = [hung_stacks(self.job_dir, paths[hb["pid"]], hb) for hb in sorted(hung, key=lambda hb: hb["rank"])]
            self.on_event(
                {
                    "event": EventKind.HANG,
                    "ranks": sorted(hb["rank"] for hb in hung),
                    "phase": first["phase"],
                    "step": first["step"],
                    "stalled_s": round(now - first["time"], 1),
                    "timeout_s": round(first["timeout_s"], 2),
                    "stalled_since": first["time"],
                    "kept": kept,
                    "stacks": stacks,
                }
            )
            for hb in hung:
                signal_process(hb["pid"], signal.SIGKILL)
        for observe in self.observers:
            observe(self.max_step)

    def limit(self, hb: dict) -> float | None:
        """The hang timeout of a worker's current phase: the spec's bound, adapted to the
        durations the worker reports (a record of the release before reports none)."""
        upper = self.timeouts.get(hb["phase"])
        if not upper:
            return None
        observed = hb.get("observed", {}).get(hb["phase"])
        if not isinstance(observed, list) or len(observed) != 2:
            return upper
        return self.adaptive.limit(upper, int(observed[0]), float(observed[1]))

    def start(self) -> HangDetector:
        def loop() -> None:
            while not self.stop.wait(self.interval):
                self.scan()

        threading.Thread(target=loop, name="hang-detector", daemon=True).start()
        return self
