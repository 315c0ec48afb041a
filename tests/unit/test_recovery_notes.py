"""The flow run's log says each recovery as it happens (pretrain.views.recovery_notes), from events
shaped as the workers, agents and savers write them (taken from a `builtin:drills` run)."""

from __future__ import annotations

import pytest

from pretrain.views.recovery_notes import RecoveryNotes

SPARE = {
    "epoch": 1,
    "event": "rollback",
    "lost_ranks": [1],
    "path": "spare",
    "rank": 0,
    "seconds": 0.0736,
    "source": "survivors",
    "step": 29,
}
HANG = {
    "event": "hang",
    "kept": [1],
    "node": 0,
    "phase": "step",
    "ranks": [0],
    "source": "agent",
    "stalled_s": 3.2,
    "step": 59,
    "timeout_s": 3.0,
}
NAN = {
    "anomaly_step": 90,
    "event": "rollback",
    "path": "in_process",
    "rank": 0,
    "seconds": 0.0511,
    "source": "memory",
    "step": 85,
}
RESTART = {"event": "start", "rank": 0, "restart_count": 1, "epoch": 0, "step": 40, "source": "memory"}

CASES = {
    "a warm spare took a lost rank": (
        SPARE,
        "rank 1 lost: a warm spare took over while the other workers kept "
        "running; training went on from step 29 (survivors) 0.07 s after the loss was noticed",
    ),
    "no spare was ready": (
        {**SPARE, "path": "replacement", "lost_ranks": [0, 1], "seconds": None},
        "ranks [0, 1] lost: new worker processes took over (no warm spare: none was ready yet, or "
        "cluster.spares_per_node is 0) while the other workers kept running; training went on "
        "from step 29 (survivors)",
    ),
    "a hang found": (
        HANG,
        "rank 0 hung (no progress in 'step' after step 59 for 3.2 s, timeout 3.0 s): killed, rank 1 kept running",
    ),
    "a hang with its stack": (
        {
            **HANG,
            "stacks": [
                {
                    "rank": 0,
                    "where": "wait (threading.py:327) from step (trainer/loop.py:9)",
                    "file": "stacks/hang-step00000059-rank0-pid7.txt",
                }
            ],
        },
        "rank 0 hung (no progress in 'step' after step 59 for 3.2 s, timeout 3.0 s): killed, rank 1 "
        "kept running; rank 0 in wait (threading.py:327) from step (trainer/loop.py:9) (every "
        "thread's stack: stacks/hang-step00000059-rank0-pid7.txt, in the job's directory)",
    ),
    "damaged: stacks not a list": (
        {**HANG, "stacks": "x"},
        "rank 0 hung (no progress in 'step' after step 59 for 3.2 s, timeout 3.0 s): killed, rank 1 kept running",
    ),
    "a hang of every rank": (
        {**HANG, "ranks": [0, 1], "kept": []},
        "ranks [0, 1] hung (no progress in 'step' after step 59 for 3.2 s, timeout 3.0 s): killed",
    ),
    "a NaN rolled back": (
        NAN,
        "the loss of step 90 was anomalous: rolled back in the live workers to step 85 (memory), "
        "that step's samples skipped",
    ),
    "every worker restarted": (RESTART, "every worker restarted (restart 1) from step 40 (memory)"),
    "rank 1's own rollback (rank 0 speaks for the job)": ({**NAN, "rank": 1}, None),
    "the spare that joined": ({"event": "start", "rank": 1, "restart_count": 0, "epoch": 1, "step": 29}, None),
    "a first start": ({**RESTART, "restart_count": 0}, None),
    "a checkpoint": ({"event": "checkpoint", "step": 20, "path": "x"}, None),
    "damaged: no fields": (
        {"event": "hang"},
        "ranks None hung (no progress in 'None' after step None for None s, timeout None s): killed",
    ),
    "damaged: odd types": (
        {**SPARE, "seconds": "soon", "lost_ranks": "1"},
        "ranks 1 lost: a warm spare took over "
        "while the other workers kept running; training went on from step 29 (survivors)",
    ),
}


@pytest.mark.parametrize("event, expected", CASES.values(), ids=CASES.keys())
def test_each_recovery_event_is_one_line(event, expected):
    assert RecoveryNotes().note(event) == expected


def test_a_savers_second_start_by_the_same_agent_is_a_restart():
    notes = RecoveryNotes()
    first = {"agent": 15896, "event": "saver_start", "pid": 15898, "source": "saver"}
    assert notes.note(first) is None
    assert notes.note({**first, "agent": 20000}) is None  # another node agent's (a new job round) first saver
    assert notes.note({**first, "pid": 15992}) == "the checkpoint saver was restarted; training did not stop"
    assert notes.note({**first, "agent": [1]}) is None  # damaged: an unhashable value is no crash
