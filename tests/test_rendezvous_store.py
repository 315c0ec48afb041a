"""A node that comes up after its job's first rendezvous round closed without it (slow to start
on a loaded machine) joins the running job: the next round's workers share one store.

Torch's c10d handler writes the store's address only in the first round a node joins (torch
2.13): without ``trainer.rendezvous_store`` the late node waits a minute for an address the
other never writes again, and both agents fail (or, if the late node had been rank 0 before,
each side's workers meet in a different store and hang)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from agents import node_log, start_agent
from conftest import seed_data, small_spec
from pretrain.jobs import build_job
from pretrain.ports import free_port
from trainer.reporting import METRICS, read_all
from trainer.rendezvous_store import RoundStoreAddress


def handler(endpoint: str, host: bool) -> RoundStoreAddress:
    params = RendezvousParameters(backend="c10d", endpoint=endpoint, run_id="late-join", min_nodes=1, max_nodes=2,
                                  is_host=host, last_call_timeout=1, join_timeout=30, read_timeout=5)
    return RoundStoreAddress(rdzv_registry.get_rendezvous_handler(params))


def address(info) -> tuple[str, int]:
    return info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)  # polls the condition


def stop(agents: list[subprocess.Popen]) -> None:
    """As an orchestrator stops a job: SIGTERM to each agent's process group (it stops its
    workers and saver, and frees its shared memory), SIGKILL if one does not end."""
    for a in agents:
        os.killpg(a.pid, signal.SIGTERM)
    for a in agents:
        try:
            a.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(a.pid, signal.SIGKILL)


def test_a_node_joining_a_running_rendezvous_meets_the_others_in_the_same_store():
    endpoint = f"127.0.0.1:{free_port()}"
    first, late = handler(endpoint, True), handler(endpoint, False)
    try:
        alone = first.next_rendezvous()  # the last call passes without the late node
        assert alone.world_size == 1
        with ThreadPoolExecutor(1) as pool:
            joining = pool.submit(late.next_rendezvous)
            wait_until(lambda: first.num_nodes_waiting() > 0, 30, "the late node waits to join")
            together = first.next_rendezvous()  # the running node's agent restarts its workers with it
            joined = joining.result(timeout=30)
        assert (together.world_size, joined.world_size) == (2, 2)
        assert {together.rank, joined.rank} == {0, 1}
        assert address(joined) == address(together) == address(alone)
    finally:
        late.shutdown()
        first.shutdown()


def test_a_node_late_at_the_start_joins_the_running_job_which_goes_on_with_both(prepared_data, tmp_path, zygote):
    """Node 0 trains alone (the job may run on one node); node 1's agent starts later: node 0's
    agent restarts its worker, and the job goes on with both from the newest snapshot, every
    sample trained on once, the global batch unchanged."""
    spec = small_spec(tmp_path, cluster={"workers_per_node": 1, "nodes_min": 1, "nodes_max": 2, "max_restarts": 3},
                      stages=[{"name": "s", "steps": 5000, "seq_len": 32, "micro_batch": 2}],
                      checkpoint={"interval": 4, "memory_interval": 2, "keep": 2},
                      # far from its last step when node 1 comes, however slowly its agent starts
                      chaos=[{"kind": "slow_worker", "rank": 0, "step": 1, "delay_s": 0.05}])
    seed_data(spec, prepared_data)
    job = build_job(spec, 0, 0, None)
    metrics = Path(job.job_dir) / METRICS
    endpoint = f"127.0.0.1:{free_port()}"
    start = lambda node: start_agent(job, 3, 1, zygote, node=node, nodes=2, nodes_min=1,  # noqa: E731
                                     endpoint=endpoint, start_new_session=True)
    agents = [start(0)]
    try:
        wait_until(lambda: metrics.exists() and len(read_all(metrics)) >= 3, 120, "node 0 trains alone")
        agents.append(start(1))
        together = lambda: [m for m in read_all(metrics) if m["world_size"] == 2]  # noqa: E731
        wait_until(lambda: len(together()) >= 5 or any(a.poll() is not None for a in agents), 180,
                   "both nodes train")
        assert len(together()) >= 5, node_log(job, 2)
    finally:
        stop(agents)
    rows = read_all(metrics)
    assert rows[0]["world_size"] == 1
    final = {m["step"]: m for m in rows}  # a step redone after the restart replaces its first row
    assert sorted(final) == list(range(1, max(final) + 1))
    assert all(m["consumed"] == 4 * step for step, m in final.items()), json.dumps(rows[-3:])
