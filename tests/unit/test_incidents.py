"""Failure causes from a job's events (pretrain/run/incidents.py): by the error's class, which the
workers and node agents write as data (``error_type``), not by words in its text."""

from __future__ import annotations

import pytest

from pretrain.run.incidents import cause_of, detected_at, incidents
from trainer.data.sampler import DataError
from trainer.job.events import EventKind, error_event


def error(text: str, error_type: str | None = None, cause_types: list[str] = ()) -> dict:
    event = {"event": "error", "time": 1.0, "error": text}
    return event if error_type is None else {**event, "error_type": error_type, "cause_types": list(cause_types)}


CASES = {
    "data error": ([error("DataError: no window of 60001 tokens", "DataError")], "data"),
    "a message that names a class is not that class": (
        [error("RuntimeError: could not open the DataError log", "RuntimeError")],
        "worker_failure:exit_1",
    ),
    "the class of what led to it": ([error("RuntimeError: loader died", "RuntimeError", ["DataError"])], "data"),
    "a saver that filled the disk": (
        [error("SaverFailed: ... last error: CheckpointDiskFull: no space", "SaverFailed", ["CheckpointDiskFull"])],
        "disk_full",
    ),
    "a saver that kept failing": (
        [error("SaverFailed: ... NotADirectoryError: x", "SaverFailed", ["NotADirectoryError"])],
        "saver_failure",
    ),
    "rollbacks before data": (
        [error("DataError: x", "DataError"), error("TooManyRollbacks: y", "TooManyRollbacks")],
        "too_many_rollbacks",
    ),
    # events files of the release before carry no error_type: the text still says the cause
    "release before: data": ([error("DataError: no window of 60001 tokens")], "data"),
    "release before: disk full": ([error("SaverFailed: ... last error: CheckpointDiskFull: no space")], "disk_full"),
    "release before: oom": ([error("OutOfMemoryError: CUDA out of memory")], "oom"),
    "no error: a hang": ([{"event": "hang", "time": 1.0}], "hang"),
    "a hang drill the process group's timeout ended": (
        [
            {"event": "chaos", "kind": "hang_worker", "time": 1.0},
            error("DistBackendError: timed out", "DistBackendError"),
        ],
        "hang",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cause_of(case):
    events, cause = CASES[case]
    assert cause_of(events, 1) == cause


def test_a_workers_error_event_carries_its_class_and_causes():
    try:
        try:
            raise DataError("no window of 60001 tokens")
        except DataError as inner:
            raise RuntimeError("start-up failed") from inner
    except RuntimeError as err:
        event = error_event(err, rank=1)
    assert event["event"] == EventKind.ERROR == "error" and event["rank"] == 1
    assert event["error"] == "RuntimeError: start-up failed"
    assert (event["error_type"], event["cause_types"]) == ("RuntimeError", ["DataError"])
    assert cause_of([{**event, "time": 1.0}], 1) == "data"


DETECTED = {  # a restart's fault records → when the fault was found
    "a hang: when the detector found it, not when the drill stopped the worker": (
        [{"event": "chaos", "kind": "hang_worker", "time": 1.0}, {"event": "hang", "time": 6.0}],
        6.0,
    ),
    "a hang ended by the process group's timeout: the timeout's error": (
        [
            {"event": "chaos", "kind": "hang_worker", "time": 1.0},
            error("DistBackendError: timed out", "DistBackendError") | {"time": 301.0},
        ],
        301.0,
    ),
    "only the drill's record: its time": ([{"event": "chaos", "kind": "hang_worker", "time": 1.0}], 1.0),
    "a killed worker: the kill": (
        [{"event": "chaos", "kind": "kill_worker", "time": 1.0}, error("x") | {"time": 1.5}],
        1.0,
    ),
    "nothing recorded: the restart": ([], 9.0),
    "a saver killed before the hang (training went on): the hang's detection": (
        [
            {"event": "chaos", "kind": "kill_saver", "time": 0.5},
            {"event": "chaos", "kind": "hang_worker", "time": 1.0},
            {"event": "hang", "time": 6.0},
        ],
        6.0,
    ),
}


@pytest.mark.parametrize("case", list(DETECTED))
def test_detected_at(case):
    window, expected = DETECTED[case]
    assert detected_at(window, default=9.0) == expected


def test_a_hang_incident_counts_the_stall_before_detection_as_lost():
    """A worker stops at t=10 (last heartbeat), the detector finds it at t=15.5, the restarted
    workers (from step 8) step again at t=19: found at 15.5, 5.5 s unnoticed, 3.5 s to recover."""
    events = [
        {"event": "start", "rank": 0, "time": 0.0, "step": 0, "source": "scratch"},
        {"event": "chaos", "kind": "hang_worker", "time": 10.01},
        {"event": "hang", "time": 15.5, "stalled_since": 10.0, "ranks": [0]},
        {"event": "start", "rank": 0, "time": 18.0, "step": 8, "source": "memory"},
    ]
    metrics = [{"step": s, "time": float(s), "step_time": 1.0} for s in range(1, 10)] + [
        {"step": 9, "time": 19.0, "step_time": 1.0}
    ]
    [incident] = incidents(events, metrics, 0)
    assert (incident["cause"], incident["detected_at"], incident["detection_s"], incident["recovery_s"]) == (
        "hang",
        15.5,
        5.5,
        3.5,
    )
    # a saver killed earlier in the same window (training went on beside it) changes nothing
    [same] = incidents(events[:1] + [{"event": "chaos", "kind": "kill_saver", "time": 5.0}] + events[1:], metrics, 0)
    assert (same["detected_at"], same["detection_s"], same["recovery_s"]) == (15.5, 5.5, 3.5)
    assert incident["steps_redone"] == 1 and incident["time_lost_s"] == 5.5 + 3.5 + 1 * 1.0


@pytest.mark.parametrize("standby, path", [(True, "spare_node"), (False, "restart"), (None, "restart")])
def test_a_lost_node_says_whether_a_standby_node_took_its_place(standby, path):
    """The orchestrator's ``node_lost`` event says whether a standby node stood by (an event of the
    release before says nothing: a restart)."""
    lost = {"event": "node_lost", "node": 1, "time": 10.5, "source": "orchestrator"}
    events = [
        {"event": "start", "rank": 0, "time": 0.0, "step": 0, "source": "scratch"},
        {"event": "chaos", "kind": "kill_node", "node": 1, "time": 10.0},
        lost if standby is None else {**lost, "standby": standby},
        {"event": "start", "rank": 0, "time": 12.0, "step": 8, "source": "checkpoint"},
    ]
    metrics = [{"step": s, "time": float(s), "step_time": 1.0} for s in range(1, 11)] + [
        {"step": 9, "time": 12.5, "step_time": 1.0}
    ]
    [incident] = incidents(events, metrics, 0)
    assert (incident["cause"], incident["recovery_path"], incident["recovery_s"]) == ("node_lost", path, 2.5)
    assert ("standby node" in incident["action"]) == (path == "spare_node")


@pytest.mark.parametrize(
    "drill, nodes_after, path",
    [
        ("kill_node", (0, 2), "spare_node"),  # the standby (node 2) trains in the lost node's place
        ("kill_node", (0,), "restart"),  # no standby: the world shrank
        ("kill_worker", (0, 2), "restart"),  # a worker lost, not a node: the full restart merely took the standby in
    ],
)
def test_a_standby_that_took_a_lost_nodes_place_before_the_orchestrator_looked_is_named(drill, nodes_after, path):
    """The new round can form before the orchestrator's next look at the nodes: its ``node_lost``
    event comes after the restart. The round's nodes say that a standby took the lost one's place."""
    events = [
        *(
            {
                "event": "start",
                "rank": r,
                "node": r,
                "epoch": 0,
                "restart_count": 0,
                "time": 0.0,
                "step": 0,
                "source": "scratch",
            }
            for r in (0, 1)
        ),
        {"event": "chaos", "kind": drill, "node": 1, "rank": 1, "time": 10.0},
        *(
            {
                "event": "start",
                "rank": r,
                "node": n,
                "epoch": 0,
                "restart_count": 1,
                "time": 10.8,
                "step": 10,
                "source": "memory",
            }
            for r, n in enumerate(nodes_after)
        ),
        {"event": "node_lost", "node": 1, "time": 11.0, "standby": True, "source": "orchestrator"},
    ]
    metrics = [{"step": s, "time": float(s), "step_time": 1.0} for s in range(1, 11)] + [
        {"step": 11, "time": 11.5, "step_time": 1.0}
    ]
    [incident] = incidents(events, metrics, 0)
    assert incident["recovery_path"] == path


def test_a_frozen_node_found_by_the_rendezvous_and_stopped_later_is_one_incident_not_two_causes():
    """A node freezes at 10 s; the rendezvous drops it at 12 s and the survivor restarts; the
    orchestrator stops the silent node (and says so) at 30 s, after a worker kill at 29 s: the
    freeze is found at the drop, and the later kill keeps its own cause and time."""
    start = {"event": "start", "rank": 0, "node": 0, "epoch": 0, "source": "memory"}
    events = [
        {**start, "rank": 1, "node": 1, "restart_count": 0, "time": 0.0, "step": 0},
        {**start, "restart_count": 0, "time": 0.0, "step": 0},
        {"event": "chaos", "kind": "freeze_node", "node": 1, "time": 10.0},
        {"event": "node_lost", "source": "rendezvous", "identity": "h:7:0", "standby": False, "time": 12.0},
        {**start, "restart_count": 1, "time": 12.5, "step": 9},
        {"event": "chaos", "kind": "kill_worker", "rank": 0, "time": 29.0},
        {"event": "node_lost", "source": "orchestrator", "node": 1, "exit_code": -9, "standby": False, "time": 30.0},
        {**start, "restart_count": 2, "time": 30.5, "step": 27},
    ]
    metrics = [{"step": s, "time": float(s), "step_time": 1.0} for s in range(1, 31)]
    first, second = incidents(events, metrics, 0)
    assert (first["cause"], first["detected_at"], first["detection_s"]) == ("node_lost", 12.0, 2.0)
    assert (second["cause"], second["detected_at"]) == ("worker_killed", 29.0)
