"""One line per recovery while a stage's job runs, read from its ``events.jsonl``: a lost worker
replaced while the others kept running, a hang found, an anomalous loss rolled back in the live
workers, every worker restarted, the checkpoint saver restarted. The flow run's log shows each
as it happens (the ledger's incidents, with their full timing, come when the job ends)."""

from __future__ import annotations

from pretrain.run.incidents import where_hung
from trainer.job.events import EventKind, replaced_workers

TAKEN_BY = {
    "spare": "a warm spare took over",
    "replacement": "new worker processes took over (no warm spare: none was ready yet, or "
    "cluster.spares_per_node is 0)",
}


def _files(e: dict) -> str:
    files = ", ".join(str(s["file"]) for s in e["stacks"] if isinstance(s, dict) and s.get("file"))
    return f" (every thread's stack: {files}, in the job's directory)" if files else ""


def _ranks(ranks) -> str:
    return f"rank {ranks[0]}" if isinstance(ranks, list) and len(ranks) == 1 else f"ranks {ranks}"


class RecoveryNotes:
    """Feed it the job's events in order; ``note`` says what a recovery event means, else None."""

    def __init__(self):
        self._savers: set[str] = set()  # node agents whose saver has started once (a second start is a restart)

    def note(self, e: dict) -> str | None:
        kind = e.get("event")
        if kind == EventKind.HANG:
            kept = f", {_ranks(e['kept'])} kept running" if e.get("kept") else ""
            where = where_hung(e)
            return (
                f"{_ranks(e.get('ranks'))} hung (no progress in '{e.get('phase')}' after step {e.get('step')} for "
                f"{e.get('stalled_s')} s, timeout {e.get('timeout_s')} s): killed{kept}"
                + (f"; {where}{_files(e)}" if where else "")
            )
        if kind == EventKind.ROLLBACK and e.get("rank") == 0:
            took = (
                f" {e['seconds']:.2f} s after the loss was noticed"
                if isinstance(e.get("seconds"), (int, float))
                else ""
            )
            if replaced_workers(e):
                return (
                    f"{_ranks(e.get('lost_ranks'))} lost: {TAKEN_BY[e['path']]} while the other workers kept running; "
                    f"training went on from step {e.get('step')} ({e.get('source')}){took}"
                )
            if e.get("path") == "in_process":
                return (
                    f"the loss of step {e.get('anomaly_step')} was anomalous: rolled back in the live workers to step "
                    f"{e.get('step')} ({e.get('source')}), that step's samples skipped"
                )
        if (
            kind == EventKind.START
            and e.get("rank") == 0
            and not e.get("epoch")
            and isinstance(e.get("restart_count"), int)
            and e["restart_count"] > 0
        ):
            return (
                f"every worker restarted (restart {e['restart_count']}) from step {e.get('step')} ({e.get('source')})"
            )
        if kind == EventKind.SAVER_START:
            agent = repr((e.get("node"), e.get("agent")))  # a damaged line's values may be anything
            if agent in self._savers:
                return "the checkpoint saver was restarted; training did not stop"
            self._savers.add(agent)
        return None
