"""Failure classification from a job's event and metric streams.

Every failure gets a cause, the action taken and how (``recovery_path``: ``in_process``: an
anomaly rolled back in the live workers; ``spare`` / ``replacement``: a lost worker replaced by a
warm spare / a cold start while the others were kept; ``restart``: every worker restarted;
``spare_node``: every worker restarted, a standby node in the lost one's place), when it was detected and how long
it went unnoticed (``detection_s``: a hang stalls training until the detector finds it), how long until training
stepped again, and the time lost (detection, recovery and the steps redone) — the raw data for a goodput ledger.
"""

from __future__ import annotations

import signal
import statistics

from trainer.job.events import EventKind

FAULT_EVENTS = (EventKind.HANG, EventKind.ANOMALY, EventKind.CHAOS, EventKind.ERROR, EventKind.NODE_LOST)
NON_RETRYABLE = {
    "too_many_rollbacks",
    "shm_too_small",
    "disk_full",
    "kube_config",
}  # relaunching cannot help: a human must act
# the cause of an error event, by the class of the error (or of what led to it), first match wins
ERROR_CAUSES = (
    ("TooManyRollbacks", "too_many_rollbacks"),
    ("ShmTooSmall", "shm_too_small"),
    ("OutOfMemoryError", "oom"),
    ("DataError", "data"),
    ("NodeExcluded", "node_check"),
    ("CheckpointDiskFull", "disk_full"),
    ("SaverFailed", "saver_failure"),
    # written by the Kubernetes backend (pretrain.cluster.kube.handle) for the pod failure that ended a job
    ("KubeConfigError", "kube_config"),
    ("PodLost", "node_lost"),
)


def error_types(event: dict) -> set[str]:
    """The classes of an error event's error and its causes. An event written by the release
    before has no ``error_type``: the classes named in its text stand in."""
    if "error_type" in event:
        return {event["error_type"], *event.get("cause_types", [])}
    text = event.get("error", "")
    return {name for name, _ in ERROR_CAUSES if name in text}


def cause_of(events: list[dict], exit_code: int | None = None) -> str:
    types = set().union(*(error_types(e) for e in events if e["event"] == EventKind.ERROR))
    for name, cause in ERROR_CAUSES:
        if name in types:
            return cause
    for e in events:
        if e["event"] == EventKind.ANOMALY:
            return "nonfinite_loss" if e["kind"] == "nonfinite" else "loss_spike"
    for e in events:
        if e["event"] == EventKind.HANG:
            return "hang"
    for e in events:  # a hang drill whose hang the process group's timeout ended before the detector saw it
        if e["event"] == EventKind.CHAOS and e["kind"] == "hang_worker":
            return "hang"
    for e in events:
        if e["event"] == EventKind.NODE_LOST:
            return "node_lost"
    for e in events:
        if e["event"] == EventKind.CHAOS and e["kind"] in ("kill_worker", "kill_node", "freeze_node"):
            return "worker_killed" if e["kind"] == "kill_worker" else "node_lost"
    if exit_code is not None and exit_code < 0:
        return f"signal:{signal.Signals(-exit_code).name}"
    return "worker_failure" if exit_code is None else f"worker_failure:exit_{exit_code}"


# drills that do not stop training (a saver is restarted beside it; a checkpoint is damaged in
# storage; a straggler): never the moment a recovery's fault was found
NOT_STOPPING = ("kill_saver", "corrupt_checkpoint", "slow_worker")


def stopping(window: list[dict]) -> list[dict]:
    return [e for e in window if not (e["event"] == EventKind.CHAOS and e.get("kind") in NOT_STOPPING)]


# drills whose injection is not their detection: a hung worker or a frozen node is found later
# (the hang detector; the rendezvous dropping the node once its keep-alives lapse)
SILENT = ("hang_worker", "freeze_node")


def detected_at(window: list[dict], default: float) -> float:
    """When the fault was found: its first record, except the injection of a silent fault
    (``SILENT``) and drills that do not stop training."""
    found = [e["time"] for e in stopping(window) if not (e["event"] == EventKind.CHAOS and e.get("kind") in SILENT)]
    return min(found or [e["time"] for e in window] or [default])


def began_at(window: list[dict], detected: float) -> float:
    """When the fault began: for a hang, the stalled worker's last heartbeat (the detector's
    ``stalled_since``); else its first record."""
    stalled = [
        e["stalled_since"]
        for e in window
        if e["event"] == EventKind.HANG and isinstance(e.get("stalled_since"), (int, float))
    ]
    return min([e["time"] for e in stopping(window)] + stalled + [detected])


def hang_dumps(window: list[dict]) -> dict:
    """``{"stacks": [...]}``: where the hung workers of ``window`` were (the hang detector's dumps:
    rank, innermost frames, the dump's file in the job's directory), or {} when it took none."""
    found = [
        s
        for e in window
        if e["event"] == EventKind.HANG and isinstance(e.get("stacks"), list)
        for s in e["stacks"]
        if isinstance(s, dict) and isinstance(s.get("where"), str)
    ]
    return {"stacks": found} if found else {}


def where_hung(failure: dict) -> str:
    """One line naming where each hung rank of a failure was ("" for other failures)."""
    stacks = failure.get("stacks")
    return (
        "; ".join(f"rank {s.get('rank')} in {s['where']}" for s in stacks if isinstance(s, dict) and "where" in s)
        if isinstance(stacks, list)
        else ""
    )


def round_nodes(events: list[dict], restart_count: int) -> set:
    """The nodes whose workers started in round ``restart_count`` of the job."""
    return {
        e.get("node")
        for e in events
        if e["event"] == EventKind.START and not e.get("epoch") and e.get("restart_count") == restart_count
    }


def standby_took_over(events: list[dict], cur: dict, window: list[dict]) -> bool:
    """Whether the restart at ``cur`` (rank 0's start) took a standby node in for a lost one: the
    orchestrator saw the loss and said so, or (when the new round formed before the orchestrator's
    next look) the round holds a node the round before did not, after a node was lost."""
    if any(e["event"] == EventKind.NODE_LOST and e.get("standby") for e in window):
        return True
    count = cur.get("restart_count")
    if not isinstance(count, int) or cause_of(window) != "node_lost":
        return False
    earlier = [
        e["restart_count"]
        for e in events
        if e["event"] == EventKind.START and isinstance(e.get("restart_count"), int) and e["restart_count"] < count
    ]
    return bool(earlier) and bool(round_nodes(events, count) - round_nodes(events, max(earlier)))


def late_losses(events: list[dict]) -> list[int]:
    """Positions in ``events`` (sorted by time) of the orchestrator's ``node_lost`` records written
    after a round had already gone on without that node (found by the agents' links or the
    rendezvous first; a frozen node is stopped, and so recorded, only after it went silent for
    ``PRETRAIN_NODE_SILENT_S``): not a fault of the recovery they fall before."""
    starts = sorted(
        (
            e
            for e in events
            if e["event"] == EventKind.START
            and e.get("rank") == 0
            and not e.get("epoch")
            and isinstance(e.get("restart_count"), int)
        ),
        key=lambda e: e["time"],
    )
    rounds = {s["restart_count"]: round_nodes(events, s["restart_count"]) for s in starts}
    late = []
    for i, e in enumerate(events):
        if e["event"] != EventKind.NODE_LOST or e.get("source") != "orchestrator" or "node" not in e:
            continue
        seen = False
        for s in (s for s in starts if s["time"] < e["time"]):
            if e["node"] in rounds[s["restart_count"]]:
                seen = True
            elif seen:  # a round without it started before this record
                late.append(i)
                break
    return late


def incidents(events: list[dict], metrics: list[dict], attempt: int) -> list[dict]:
    """One record per in-job recovery (a restart of the workers, or an in-process rollback:
    ``recovery_path``) and per saver restart seen in a job's streams."""
    events = sorted(events, key=lambda e: e["time"])
    late = set(late_losses(events))
    faults = [e for i, e in enumerate(events) if e["event"] in FAULT_EVENTS and i not in late]
    step_time = statistics.median([m["step_time"] for m in metrics]) if metrics else 0.0
    # where training went on after a fault: a restart of the workers, or an in-process rollback
    # (a replacement joining kept workers starts in a later epoch: rank 0's rollback event marks that recovery)
    points = [
        e
        for e in events
        if (e["event"] == EventKind.START and e.get("rank") == 0 and not e.get("epoch"))
        or e["event"] == EventKind.ROLLBACK
    ]
    out = []
    for prev, cur in zip(points, points[1:]):
        window = [e for e in faults if prev["time"] < e["time"] <= cur["time"]]
        detected = detected_at(window, default=cur["time"])
        detection = detected - began_at(window, detected)  # a hang stalls training until it is found
        reached = max((m["step"] for m in metrics if prev["time"] <= m["time"] <= detected), default=cur["step"])
        resumed = next((m["time"] for m in metrics if m["time"] > cur["time"]), None)
        recovery = (resumed - detected) if resumed else None
        redone = max(0, reached - cur["step"])
        path = (
            cur.get("path", "in_process")
            if cur["event"] == EventKind.ROLLBACK
            else "spare_node"
            if standby_took_over(events, cur, window)
            else "restart"
        )
        action = {
            "in_process": f"roll back in process to {cur['source']} step {cur['step']}",
            "restart": f"restart workers from {cur['source']} step {cur['step']}",
            "spare_node": f"restart workers with a standby node for the lost one, from {cur['source']} step "
            f"{cur['step']}",
        }.get(
            path,
            f"replace rank(s) {cur.get('lost_ranks')} ({path}), others kept, from {cur['source']} step {cur['step']}",
        )
        out.append(
            {
                "attempt": attempt,
                "in_job": True,
                "cause": cause_of(window),
                "action": action,
                "recovery_path": path,
                "detected_at": detected,
                "detection_s": round(detection, 2),
                "recovery_s": None if recovery is None else round(recovery, 2),
                "steps_redone": redone,
                "time_lost_s": round(detection + (recovery or 0.0) + redone * step_time, 2),
                **hang_dumps(window),
            }
        )
    saver_starts: dict[int, int] = {}
    for e in (e for e in events if e["event"] == EventKind.SAVER_START):
        saver_starts[e.get("agent", 0)] = saver_starts.get(e.get("agent", 0), 0) + 1
        if saver_starts[e.get("agent", 0)] == 1:
            continue  # each node agent starts one saver; later starts replace a dead one
        out.append(
            {
                "attempt": attempt,
                "in_job": True,
                "cause": "saver_failure",
                "action": "saver restarted by the node agent",
                "detected_at": e["time"],
                "recovery_s": None,
                "steps_redone": 0,
                "time_lost_s": 0.0,
            }
        )
    return out
