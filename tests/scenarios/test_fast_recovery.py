"""Fast recovery under the single-node agent (issue 16 §1–§4): a worker killed mid-step is
replaced by a warm spare while the other worker keeps its process, its model and its optimizer;
the run ends bit for bit as the fault-free run; a fast path that cannot finish in time falls
back to the full restart and the job still completes. (Its parts on their own, without a job:
test_fast_recovery_protocol.py.)"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest
import torch

from pretrain.cluster.ports import free_port
from pretrain.run.incidents import incidents
from pretrain.run.jobs import build_job
from support.agents import node_log, run_agent, run_agents, start_agent
from support.campaigns import seed_data, small_spec
from trainer.checkpoint.store import stage_store
from trainer.job.config import JobConfig
from trainer.job.reporting import EVENTS, METRICS, read_all

STEPS = 14


def two_worker_job(
    root: Path, prepared_data: Path, chaos: list[dict], spares_per_node: int = 1, **fault_tolerance
) -> JobConfig:
    """One node, two DDP workers, snapshots in memory every 2 steps (persisted every 4); the
    adaptive hang timeout does not start before the faults (a drill waits for the warm spare)."""
    spec = small_spec(
        root,
        cluster={"workers_per_node": 2, "max_restarts": 3, "spares_per_node": spares_per_node},
        stages=[{"name": "s", "steps": STEPS, "seq_len": 32, "micro_batch": 2, "warmup_steps": 2}],
        checkpoint={"interval": 4, "memory_interval": 2, "keep": 2},
        fault_tolerance={"hang_warmup_steps": 50, **fault_tolerance},
        chaos=chaos,
    )
    seed_data(spec, prepared_data)
    return build_job(spec, 0, 0, None)


def final_model(cfg: JobConfig) -> dict:
    store = stage_store(cfg)
    return store.load_shard(store.read_pointer(), "model.pt")["model"]


def by_kind(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["event"] == kind]


@pytest.fixture(scope="module")
def clean_model(prepared_data, tmp_path_factory, zygote) -> dict:
    job = two_worker_job(tmp_path_factory.mktemp("clean"), prepared_data, [])
    assert run_agent(job, max_restarts=3, nproc=2, zygote=zygote) == 0, node_log(job)
    return final_model(job)


def test_a_killed_worker_is_replaced_by_a_warm_spare_and_the_survivor_keeps_running(
    prepared_data, tmp_path, clean_model, zygote
):
    """Rank 1 SIGKILLed before step 6, then rank 0 (by then a survivor of the first fault) before
    step 10: each time the other worker keeps its process and its state (no rollback to the
    snapshot of step 4 or 8: training goes on from the step it completed), a warm spare takes
    the lost rank, a new spare is started for the next fault, and the result is bitwise the
    fault-free run's."""
    job = two_worker_job(
        tmp_path,
        prepared_data,
        [{"kind": "kill_worker", "rank": 1, "step": 6}, {"kind": "kill_worker", "rank": 0, "step": 10}],
    )
    assert run_agent(job, max_restarts=3, nproc=2, zygote=zygote) == 0, node_log(job)
    events = read_all(Path(job.job_dir) / EVENTS)
    starts = {e["rank"]: e for e in by_kind(events, "start") if not e["epoch"]}
    rejoined = by_kind(events, "rejoined")
    assert len(rejoined) == 2, node_log(job)
    first, second = rejoined
    # fault 1: rank 0 survived in the process it started in; fault 2: the spare that became rank 1 survived
    assert (first["rank"], first["epoch"], first["lost_ranks"]) == (0, 1, [1])
    assert first["pid"] == starts[0]["pid"]
    assert (second["rank"], second["epoch"], second["lost_ranks"]) == (1, 2, [0])
    replacements = [e for e in by_kind(events, "start") if e["epoch"]]
    assert [(e["rank"], e["epoch"]) for e in replacements] == [(1, 1), (0, 2)]
    assert second["pid"] == replacements[0]["pid"]  # the first replacement kept its process through the second fault
    assert len({starts[0]["pid"], starts[1]["pid"], *(e["pid"] for e in replacements)}) == 4
    # each recovery took a spare that was warm before its fault; a new one was warm before the next fault
    warm = {e["pid"]: e["time"] for e in by_kind(events, "spare_ready")}
    kills = by_kind(events, "chaos")
    assert [warm[e["pid"]] < kill["time"] for e, kill in zip(replacements, kills)] == [True, True]
    rollbacks = by_kind(events, "rollback")
    assert [(r["path"], r["lost_ranks"]) for r in rollbacks] == [("spare", [1]), ("spare", [0])]
    assert [(r["source"], r["step"]) for r in rollbacks] == [("survivors", 5), ("survivors", 9)]
    assert not [e for e in events if e["event"] == "start" and e["restart_count"]]  # no full restart
    # the ledger's incidents say how each was recovered
    found = incidents(events, read_all(Path(job.job_dir) / METRICS), 0)
    assert [(i["cause"], i["recovery_path"]) for i in found] == [("worker_killed", "spare")] * 2
    assert all(i["recovery_s"] is not None for i in found)

    model = final_model(job)
    assert model.keys() == clean_model.keys() and all(torch.equal(model[k], clean_model[k]) for k in model)


def test_a_hung_worker_is_killed_alone_and_replaced_while_the_other_keeps_running(
    prepared_data, tmp_path, clean_model, zygote
):
    """Rank 1 hangs at step 5 (3 s step timeout): rank 0, waiting for it in the step's
    collective, is not taken for hung; only rank 1 is killed, a spare takes its rank."""
    job = two_worker_job(tmp_path, prepared_data, [{"kind": "hang_worker", "rank": 1, "step": 5}])
    job = job.amended(fault_tolerance={"step_timeout_s": 3.0})
    assert run_agent(job, max_restarts=3, nproc=2, zygote=zygote) == 0, node_log(job)
    events = read_all(Path(job.job_dir) / EVENTS)
    [hang] = by_kind(events, "hang")
    assert (hang["ranks"], hang["kept"]) == ([1], [0])
    [start0] = [e for e in by_kind(events, "start") if e["rank"] == 0]
    [rejoined] = by_kind(events, "rejoined")
    assert (rejoined["rank"], rejoined["pid"]) == (0, start0["pid"])
    [incident] = incidents(events, read_all(Path(job.job_dir) / METRICS), 0)
    assert (incident["cause"], incident["recovery_path"]) == ("hang", "spare")
    model = final_model(job)
    assert all(torch.equal(model[k], clean_model[k]) for k in model)


def test_a_fast_recovery_that_cannot_finish_in_time_falls_back_to_a_full_restart(
    prepared_data, tmp_path, clean_model, zygote
):
    job = two_worker_job(
        tmp_path,
        prepared_data,
        [{"kind": "kill_worker", "rank": 1, "step": 5}],
        fast_recovery_timeout_s=0.001,
        spares_per_node=0,
    )
    assert run_agent(job, max_restarts=3, nproc=2, zygote=zygote) == 0, node_log(job)
    assert "(rank(s) [0, 1] not restored in the new process group): restarting every worker" in node_log(job)
    events = read_all(Path(job.job_dir) / EVENTS)
    assert sorted(e["restart_count"] for e in by_kind(events, "start") if e["rank"] == 0) == [0, 1]
    [incident] = incidents(events, read_all(Path(job.job_dir) / METRICS), 0)
    assert (incident["cause"], incident["recovery_path"]) == ("worker_killed", "restart")
    model = final_model(job)
    assert all(torch.equal(model[k], clean_model[k]) for k in model)


ON_TWO_NODES = {  # the fault of rank 1 (node 1's worker) before step 6, spares per node → cause, recovery path
    "killed, warm spare": ({"kind": "kill_worker", "rank": 1, "step": 6}, 1, "worker_killed", "spare"),
    "hung, warm spare": ({"kind": "hang_worker", "rank": 1, "step": 6}, 1, "hang", "spare"),
    "killed, cold start": ({"kind": "kill_worker", "rank": 1, "step": 6}, 0, "worker_killed", "replacement"),
}


@pytest.mark.parametrize("fault", list(ON_TWO_NODES))
def test_on_two_nodes_a_lost_worker_is_replaced_and_the_other_nodes_worker_keeps_running(
    fault, prepared_data, tmp_path, clean_model, zygote
):
    """Two nodes of one worker each (torch's elastic agents, c10d rendezvous): rank 1, node 1's
    worker, is SIGKILLed (or hangs, and its node's agent kills it: 3 s step timeout; node 0's
    agent, whose worker waits in the step's collective, leaves it alone). Node 0's worker keeps
    its process and its state (no full restart of the job: torch's agent alone would restart
    both); node 1's warm spare, started before the fault, takes rank 1 (no spare: node 1's agent
    starts a replacement), its state from the survivor; the result is bitwise the run of one node
    with two workers."""
    drill, spares, cause, path = ON_TWO_NODES[fault]
    job = two_worker_job(tmp_path, prepared_data, [drill], spares_per_node=spares)
    job = job.amended(fault_tolerance={"step_timeout_s": 3.0})
    # node timeout 10: survivors wait 5 s for the announcement (a node agent starved of CPU on a loaded machine)
    assert run_agents(job, max_restarts=3, nproc=1, zygote=zygote, nodes=2, node_timeout=10) == 0, node_log(
        job, nodes=2
    )
    events = read_all(Path(job.job_dir) / EVENTS)
    starts = {e["rank"]: e for e in by_kind(events, "start") if not e["epoch"]}
    assert {starts[0]["node"], starts[1]["node"]} == {0, 1}
    [rejoined] = by_kind(events, "rejoined")
    assert (rejoined["rank"], rejoined["epoch"], rejoined["lost_ranks"], rejoined["pid"]) == (
        0,
        1,
        [1],
        starts[0]["pid"],
    )
    [replacement] = [e for e in by_kind(events, "start") if e["epoch"]]
    assert (replacement["rank"], replacement["node"]) == (1, starts[1]["node"])
    assert not [e for e in by_kind(events, "start") if e["restart_count"]], node_log(job, nodes=2)  # no full restart
    [rollback] = by_kind(events, "rollback")
    assert (rollback["path"], rollback["source"], rollback["step"]) == (path, "survivors", 5)
    [incident] = incidents(events, read_all(Path(job.job_dir) / METRICS), 0)
    assert (incident["cause"], incident["recovery_path"]) == (cause, path)
    warm = {e["pid"]: e["time"] for e in by_kind(events, "spare_ready")}
    [kill] = [e for e in events if e["event"] in ("chaos", "hang")][:1]
    assert (replacement["pid"] in warm and warm[replacement["pid"]] < kill["time"]) == bool(spares)
    model = final_model(job)
    assert all(torch.equal(model[k], clean_model[k]) for k in model)


def test_on_two_nodes_a_warm_spare_is_started_again_for_the_next_fault(prepared_data, tmp_path, clean_model, zygote):
    """Node 1 loses its worker twice (rank 1 before step 6, then its replacement before step 10):
    each time a spare of node 1 that was warm before the fault takes the rank, node 0's worker
    keeps its process throughout, and the run is bitwise the one-node run."""
    job = two_worker_job(
        tmp_path,
        prepared_data,
        [{"kind": "kill_worker", "rank": 1, "step": 6}, {"kind": "kill_worker", "rank": 1, "step": 10}],
    )
    assert run_agents(job, max_restarts=3, nproc=1, zygote=zygote, nodes=2) == 0, node_log(job, nodes=2)
    events = read_all(Path(job.job_dir) / EVENTS)
    starts = {e["rank"]: e for e in by_kind(events, "start") if not e["epoch"]}
    assert [(e["rank"], e["pid"]) for e in by_kind(events, "rejoined")] == [(0, starts[0]["pid"])] * 2
    replacements = [e for e in by_kind(events, "start") if e["epoch"]]
    assert [(e["rank"], e["node"], e["epoch"]) for e in replacements] == [
        (1, starts[1]["node"], 1),
        (1, starts[1]["node"], 2),
    ]
    warm = {e["pid"]: e["time"] for e in by_kind(events, "spare_ready")}
    kills = by_kind(events, "chaos")
    assert [warm.get(e["pid"], float("inf")) < kill["time"] for e, kill in zip(replacements, kills)] == [True, True]
    assert [r["path"] for r in by_kind(events, "rollback")] == ["spare", "spare"]
    model = final_model(job)
    assert all(torch.equal(model[k], clean_model[k]) for k in model)


def test_on_two_nodes_a_fast_recovery_that_cannot_finish_falls_back_to_torchs_full_restart(
    prepared_data, tmp_path, clean_model, zygote
):
    """The replacement cannot be restored in time (the bound is 1 ms): node 1's agent hands the
    failure to torch's agent, which restarts every worker of both nodes; the job completes, bitwise.
    (No warm spare, as on one node: a warm spare and the survivor arriving within the same
    millisecond finished the recovery in a CI run, just before the agent's fallback.)"""
    job = two_worker_job(
        tmp_path,
        prepared_data,
        [{"kind": "kill_worker", "rank": 1, "step": 5}],
        fast_recovery_timeout_s=0.001,
        spares_per_node=0,
    )
    assert run_agents(job, max_restarts=3, nproc=1, zygote=zygote, nodes=2) == 0, node_log(job, nodes=2)
    assert "not restored in the new process group): restarting every worker" in node_log(job, nodes=2)
    events = read_all(Path(job.job_dir) / EVENTS)
    assert sorted(e["restart_count"] for e in by_kind(events, "start") if e["rank"] == 0 and not e["epoch"]) == [0, 1]
    [incident] = incidents(events, read_all(Path(job.job_dir) / METRICS), 0)
    assert (incident["cause"], incident["recovery_path"]) == ("worker_killed", "restart")
    model = final_model(job)
    assert all(torch.equal(model[k], clean_model[k]) for k in model)


def test_on_two_nodes_workers_lost_on_both_at_once_are_recovered_by_one_full_restart(
    prepared_data, tmp_path, clean_model, zygote
):
    """Both nodes lose their worker at the same step: both agents announce a recovery (two epochs,
    each waiting for a rank the other replaces). The agent that sees the other's announcement gives
    up at once and torch's agents restart every worker, instead of both waiting out the bound;
    the job completes, bitwise."""
    job = two_worker_job(
        tmp_path,
        prepared_data,
        [{"kind": "kill_worker", "rank": 0, "step": 6}, {"kind": "kill_worker", "rank": 1, "step": 6}],
    )
    assert run_agents(job, max_restarts=3, nproc=1, zygote=zygote, nodes=2) == 0, node_log(job, nodes=2)
    log = node_log(job, nodes=2)
    assert "the fast recovery was not done within" not in log, log  # nobody waited for the bound (30 s)
    events = read_all(Path(job.job_dir) / EVENTS)
    assert sorted(e["restart_count"] for e in by_kind(events, "start") if e["rank"] == 0 and not e["epoch"]) == [0, 1]
    model = final_model(job)
    assert all(torch.equal(model[k], clean_model[k]) for k in model)


def test_a_node_lost_while_the_survivors_are_outside_a_collective_restarts_them_at_once(
    prepared_data, tmp_path, zygote
):
    """Node 1 is killed while node 0's worker is busy outside any collective (a long step of its
    own; here a straggler drill's sleep of ``DELAY`` s): nothing fails for it to notice. Its agent
    announces the loss and, as no worker left, restarts them into the next round at once instead
    of leaving them until their next collective (seen once: a survivor that never left, its agent
    silent for minutes). The job completes on node 0."""
    delay = 12.0
    spec = small_spec(
        tmp_path,
        cluster={"workers_per_node": 1, "nodes_min": 1, "nodes_max": 2, "max_restarts": 2},
        stages=[{"name": "s", "steps": 4, "seq_len": 32, "micro_batch": 2, "warmup_steps": 1}],
        checkpoint={"interval": 2, "memory_interval": 1, "keep": 2},
        fault_tolerance={"hang_warmup_steps": 50},  # the sleep is no hang: the spec's 300 s bound
        chaos=[
            {"kind": "kill_node", "node": 1, "step": 4},
            *({"kind": "slow_worker", "rank": r, "step": 4, "delay_s": delay} for r in (0, 1)),
        ],
    )
    seed_data(spec, prepared_data)
    job = build_job(spec, 0, 0, None)
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [
        start_agent(
            job, max_restarts=2, zygote=zygote, node=n, nodes=2, nodes_min=1, endpoint=endpoint, start_new_session=True
        )
        for n in range(2)
    ]
    try:
        assert agents[0].wait(180) == 0, node_log(job, nodes=2)
    finally:
        for agent in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
    events = read_all(Path(job.job_dir) / EVENTS)
    [killed] = [e["time"] for e in by_kind(events, "chaos") if e.get("kind") == "kill_node"]
    [again] = [e["time"] for e in by_kind(events, "start") if e.get("world_size") == 1]
    assert again - killed < delay / 2, node_log(job, nodes=2)  # not after the sleep
    assert "the workers did not leave within" in node_log(job, nodes=2)
