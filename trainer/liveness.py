"""A node agent's sign of life, for an orchestrator that knows its nodes only as processes.

A node whose agent is frozen (stopped, swapped out for good, its machine hung) neither exits nor
closes its sockets: torch's rendezvous drops it once its keep-alives lapse and the others go on,
but whoever started it would wait for its exit code for ever. Every node agent therefore
refreshes ``<job_dir>/nodes/node<N>.json`` (its process id, written once; then only its
modification time, every ``LIVENESS_INTERVAL_S``) from a thread of its own. The local cluster's
job handle (``pretrain.cluster.local``) reads how long a running node has been silent and stops a node
silent for too long, which makes it a lost node like any other.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from trainer.common.atomic import atomic_write_json
from trainer.job.layout import JobLayout

LIVENESS_INTERVAL_S = 1.0  # how often an agent refreshes its liveness file


def liveness_path(job_dir: str | Path, node: int) -> Path:
    return JobLayout.of(job_dir).liveness(node)


class NodeLiveness:
    """Refreshes this agent's liveness file until ``stop()``; the file names this process."""

    def __init__(self, job_dir: str | Path, node: int, interval_s: float = LIVENESS_INTERVAL_S):
        self.path, self.interval_s = liveness_path(job_dir, node), interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-liveness", daemon=True)

    def start(self) -> NodeLiveness:
        """Write the file and refresh it from now on; a file that cannot be written (a read-only
        job directory) is said once and does not stop the node: it is then never taken for silent."""
        try:
            atomic_write_json(self.path, {"pid": os.getpid(), "started": time.time()})
        except OSError as err:
            print(
                f"no liveness file ({err}): a frozen node is found only by the rendezvous", file=sys.stderr, flush=True
            )
            return self
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                os.utime(self.path)
            except OSError:
                pass  # the job directory is away for a moment (or gone at the job's end): the next beat tries again


def silent_for(job_dir: str | Path, node: int, pid: int | None, now: float | None = None) -> float | None:
    """Seconds since node ``node``'s agent (process ``pid``; None: whichever wrote it) last
    refreshed its liveness file; None when there is no file of that process to judge by (not
    written yet, from another process, or damaged: such a node is never taken for silent)."""
    path = liveness_path(job_dir, node)
    try:
        record = json.loads(path.read_text())
        mtime = path.stat().st_mtime
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or (pid is not None and record.get("pid") != pid):
        return None
    return max(0.0, (time.time() if now is None else now) - mtime)


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer.liveness JOB_DIR NODE SILENT_S``: exit 1 when node NODE's agent has
    been silent for SILENT_S seconds or more (a Kubernetes liveness probe), else 0."""
    job_dir, node, limit = sys.argv[1:] if argv is None else argv
    silent = silent_for(job_dir, int(node), pid=None)
    if silent is not None and silent >= float(limit):
        print(f"node {node}: its agent gave no sign of life for {silent:.0f}s ({liveness_path(job_dir, int(node))})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
