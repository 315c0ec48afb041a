"""A node that comes up after its job's first rendezvous round closed without it (slow to start
on a loaded machine) joins the running job: the next round's workers share one store.

Torch's c10d handler writes the store's address only in the first round a node joins (torch
2.13): without ``trainer.agent.rendezvous_store`` the late node waits a minute for an address the
other never writes again, and both agents fail (or, if the late node had been rank 0 before,
each side's workers meet in a different store and hang). And a round that only took a node in
keeps torch's restart count, which named the workers' keys in that store: the rounds are numbered
(``round``), the same on every node."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from pretrain.cluster.ports import free_port
from pretrain.run.jobs import build_job
from support.agents import node_log, run_id, start_agent
from support.campaigns import kept_trajectory, seed_data, small_spec, wait_for
from trainer.agent.elastic import rendezvous_configs
from trainer.agent.first_round import checked_in, gather_nodes
from trainer.job.reporting import EVENTS, METRICS, read_all

LAST_CALL_S = rendezvous_configs(argparse.Namespace(node_timeout=3, rdzv_host=False))["last_call_timeout"]


def stop(agents: list[subprocess.Popen]) -> None:
    """As an orchestrator stops a job: SIGTERM to each agent's process group (it stops its
    workers and saver, and frees its shared memory), SIGKILL if one does not end."""
    for a in agents:
        try:
            os.killpg(a.pid, signal.SIGTERM)
        except ProcessLookupError:  # it ended, and all it started with it
            pass
    for a in agents:
        try:
            a.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(a.pid, signal.SIGKILL)


def test_a_node_late_at_the_start_joins_the_running_job_which_goes_on_with_both(prepared_data, tmp_path, zygote):
    """Node 0 trains alone (the job may run on one node); node 1's agent starts later: node 0's
    agent restarts its worker, and the job goes on with both from the newest snapshot, every
    sample trained on once, the global batch unchanged."""
    spec = small_spec(
        tmp_path,
        cluster={"workers_per_node": 1, "nodes_min": 1, "nodes_max": 2, "max_restarts": 3},
        stages=[{"name": "s", "steps": 5000, "seq_len": 32, "micro_batch": 2}],
        checkpoint={"interval": 4, "memory_interval": 2, "keep": 2},
        # far from its last step when node 1 comes, however slowly its agent starts
        chaos=[{"kind": "slow_worker", "rank": 0, "step": 1, "delay_s": 0.05}],
        # the round that takes node 1 in checks the nodes (as after any restart): on a loaded
        # machine its timing could take either node for slow (and the slowed rank 0 is slow)
        fault_tolerance={"node_check_threshold": 1000},
    )
    seed_data(spec, prepared_data)
    job = build_job(spec, 0, 0, None)
    metrics = Path(job.job_dir) / METRICS
    endpoint = f"127.0.0.1:{free_port()}"

    # first_round_wait 0: node 1 comes after the first round gave up waiting for it
    def start(node):
        return start_agent(
            job,
            3,
            1,
            zygote,
            node=node,
            nodes=2,
            nodes_min=1,
            endpoint=endpoint,
            first_round_wait=0,
            start_new_session=True,
        )

    agents = [start(0)]
    try:
        wait_for(lambda: metrics.exists() and len(read_all(metrics)) >= 3, 120, "node 0 trains alone")
        agents.append(start(1))
        together = lambda: [m for m in read_all(metrics) if m["world_size"] == 2]  # noqa: E731
        wait_for(lambda: len(together()) >= 5 or any(a.poll() is not None for a in agents), 180, "both nodes train")
        assert len(together()) >= 5, node_log(job, 2)
    finally:
        stop(agents)
    rows = read_all(metrics)
    assert rows[0]["world_size"] == 1
    # the round that took node 1 in is numbered anew, the same number on both nodes (their keys in the store)
    starts = [e for e in read_all(Path(job.job_dir) / EVENTS) if e["event"] == "start"]
    assert (starts[0]["world_size"], starts[0]["restart_count"]) == (1, 0)
    rounds: dict[int, set[int]] = {}
    for e in starts:
        if e["world_size"] == 2 and not e["epoch"]:
            rounds.setdefault(e["restart_count"], set()).add(e["node"])
    assert rounds and min(rounds) >= 1 and all(nodes == {0, 1} for nodes in rounds.values()), starts
    kept_trajectory(rows, max(m["step"] for m in rows), global_batch=4)


def test_the_first_round_waits_for_a_node_that_starts_after_torchs_last_call(prepared_data, tmp_path, zygote):
    """Node 1's agent starts more than torch's last call (5 s) after node 0's checked in: the job
    still starts on both nodes at once (no restart to take the late node in), as launched."""
    spec = small_spec(
        tmp_path,
        cluster={"workers_per_node": 1, "nodes_min": 1, "nodes_max": 2, "max_restarts": 3},
        stages=[{"name": "s", "steps": 6, "seq_len": 32, "micro_batch": 2}],
        checkpoint={"interval": 4, "memory_interval": 2, "keep": 2},
    )
    seed_data(spec, prepared_data)
    job = build_job(spec, 0, 0, None)
    metrics = Path(job.job_dir) / METRICS
    endpoint, name = f"127.0.0.1:{free_port()}", run_id(job)

    def start(node):
        return start_agent(
            job,
            3,
            1,
            zygote,
            node=node,
            nodes=2,
            nodes_min=1,
            endpoint=endpoint,
            start_new_session=True,
        )

    agents = [start(0)]
    try:
        wait_for(lambda: checked_in(endpoint, name) >= 1, 120, "node 0's agent checks in")
        # node 1 is late by more than the rendezvous's last call; meanwhile node 0 must not start the job alone
        late_until = time.monotonic() + LAST_CALL_S + 1
        while time.monotonic() < late_until:
            assert not metrics.exists(), "node 0 started the job alone"
            time.sleep(0.05)  # polls the condition until node 1 is that late
        agents.append(start(1))
        assert [a.wait(180) for a in agents] == [0, 0], node_log(job, 2)
    finally:
        stop(agents)
    rows = read_all(metrics)
    assert [m["step"] for m in rows] == list(range(1, 7)) and {m["world_size"] for m in rows} == {2}, rows
    starts = [e for e in read_all(Path(job.job_dir) / EVENTS) if e["event"] == "start"]
    assert sorted((e["node"], e["restart_count"]) for e in starts) == [(0, 0), (1, 0)], starts
    assert "waited" in node_log(job, 2)  # node 0 said why it started late


@pytest.mark.parametrize(
    "nodes, wait_s, late, expected",
    [
        (2, 0.3, False, 1),  # the other node never comes: the first stops waiting and says so
        (2, 30, True, 2),  # the other comes: both go on
        (3, 0, False, 1),  # no wait asked for (it checks in all the same)
        (1, 30, False, 1),  # a job of one node never waits
    ],
)
def test_gather_nodes(nodes, wait_s, late, expected, capfd):
    port = free_port()
    host = TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False
    )  # as node 0's rendezvous handler hosts it
    endpoint, results = f"127.0.0.1:{port}", {}
    first = threading.Thread(target=lambda: results.update(first=gather_nodes(endpoint, "job", nodes, wait_s)))
    first.start()
    if late:
        wait_for(lambda: checked_in(endpoint, "job") == 1, 30, "the first node checks in")
        assert first.is_alive()
        results["late"] = gather_nodes(endpoint, "job", nodes, wait_s, node=1)
    first.join(60)
    assert results["first"] == expected and results.get("late", expected) == expected
    said = capfd.readouterr().err
    assert (f"1 of the job's {nodes} nodes started" in said) == (nodes > 1 and wait_s > 0 and not late), said
    del host
