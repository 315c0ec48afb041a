"""What a job's ``events.jsonl`` holds: the kinds of event (``"event"`` of each line), and the
structured error event. Written by the workers, savers and node agents (and the orchestrator's
``node_lost`` / ``node_recheck``); read by ``pretrain.run.incidents`` to classify failures."""

from __future__ import annotations

from enum import StrEnum


class EventKind(StrEnum):
    START = "start"  # a worker (re)started: rank, node, step, source (checkpoint / init / scratch), restart_count
    DONE = "done"  # a worker finished its last step
    CHECKPOINT = "checkpoint"  # a checkpoint was committed: step, path
    SNAPSHOT_SKIPPED = "snapshot_skipped"  # the in-memory slot was busy
    SHM_FALLBACK = "shm_fallback"  # too little shared memory: direct checkpoints instead
    ANOMALY = "anomaly"  # a non-finite loss or a loss spike: kind, step, loss
    # training went on in the live workers: path in_process (an anomaly rolled back: anomaly_step), spare /
    # replacement (a lost worker replaced, the others kept: lost_ranks, epoch); step, source, seconds
    ROLLBACK = "rollback"
    SPARE_READY = "spare_ready"  # a warm spare has its model built and waits for a rank: spare (its id)
    # a worker that survived a lost peer joined the new group: epoch, lost_ranks, step (the lost ranks' replacements
    # write START)
    REJOINED = "rejoined"
    HANG = "hang"  # ranks stopped beating
    ERROR = "error"  # a worker or node agent failed: error, error_type, cause_types
    CHAOS = "chaos"  # a fault drill fired: kind
    SAVER_START = "saver_start"
    SAVER_ERROR = "saver_error"
    COMMIT_REFUSED = "commit_refused"
    COMMIT_DEFERRED = "commit_deferred"  # the campaign lease could not be read: the commit waits for the next poll
    PERSIST_SKIPPED = "persist_skipped"
    PERSISTED = "persisted"
    BREAKPOINT_SAVE = "breakpoint_save"
    NODE_CHECK = "node_check"
    NODE_EXCLUDED = "node_excluded"
    SHM_SWEPT = "shm_swept"
    # by the orchestrator: node, exit_code, standby (a standby node takes its place); by a node agent whose
    # rendezvous dropped a silent participant (source "rendezvous"): identity, agent_node
    NODE_LOST = "node_lost"
    NODE_RECHECK = "node_recheck"  # written by the orchestrator


SURVIVORS = "survivors"  # a start's ``source``: the state the ranks that survived a lost peer hold in memory
# a start's ``source`` restored in the live processes; "init_from" / "scratch" need fresh processes
IN_PROCESS_SOURCES = (SURVIVORS, "memory", "checkpoint")
REPLACEMENT_PATHS = ("spare", "replacement")  # fast recoveries that replaced a lost worker (ROLLBACK ``path``)


def replaced_workers(event: dict) -> bool:
    """Whether ``event`` marks a fast recovery that replaced lost workers (rank 0's rollback with
    a spare / replacement path; each rank writes its own in-process rollbacks)."""
    return (
        event.get("event") == EventKind.ROLLBACK and event.get("rank") == 0 and event.get("path") in REPLACEMENT_PATHS
    )


def cause_types(err: BaseException) -> list[str]:
    """The class names of what led to ``err`` (its ``__cause__`` / ``__context__`` chain)."""
    names, seen, cur = [], {id(err)}, err.__cause__ or err.__context__
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        names.append(type(cur).__name__)
        cur = cur.__cause__ or cur.__context__
    return names


def error_event(err: BaseException, **fields) -> dict:
    """The error event for ``err``: its text, and its class (and its causes' classes) as data,
    which failure classification reads instead of the text."""
    return {
        "event": EventKind.ERROR,
        **fields,
        "error": f"{type(err).__name__}: {err}",
        "error_type": type(err).__name__,
        "cause_types": cause_types(err),
    }
