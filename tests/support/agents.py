"""Helpers for tests of the node agent and its saver: one real agent (``python -m trainer.launch``)
for a stage of a small spec, and snapshots in shared memory for a saver to persist."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch

from pretrain.cluster.ports import free_port
from pretrain.run.jobs import build_job, write_job
from support.campaigns import seed_data, small_spec
from trainer.checkpoint.flash import SnapshotStore
from trainer.job.config import JobConfig
from trainer.zygote.client import Zygote


def agent_job(
    workdir: Path, prepared_data: Path, attempt: int = 0, steps: int = 4, sections: dict | None = None, **checkpoint
) -> JobConfig:
    """A one-stage, one-node, one-worker job of ``steps`` steps (checkpoint settings overridable;
    ``sections``: other spec sections, e.g. ``chaos``)."""
    spec = small_spec(
        workdir,
        cluster={"workers_per_node": 1, "max_restarts": 0},
        stages=[{"name": "s", "steps": steps, "seq_len": 32, "micro_batch": 2}],
        checkpoint={"interval": 2, "memory_interval": 1, "keep": 2, **checkpoint},
        **(sections or {}),
    )
    seed_data(spec, prepared_data)
    return build_job(spec, 0, attempt, None)


def run_id(job: JobConfig) -> str:
    """The job's name in the rendezvous: the same on each of its nodes, another test's job never has it."""
    return f"{Path(job.job_dir).name}-{zlib.crc32(str(job.job_dir).encode()):08x}"


def start_agent(
    job: JobConfig,
    max_restarts: int = 0,
    nproc: int = 1,
    zygote: Zygote | None = None,
    node: int = 0,
    nodes: int = 1,
    endpoint: str | None = None,
    node_timeout: int = 3,
    nodes_min: int | None = None,
    first_round_wait: float | None = None,
    **popen,
) -> subprocess.Popen:
    """The job's node agent (``max_restarts``: in-job restarts of its ``nproc`` workers); with
    ``zygote`` it forks its workers, spares and saver from it, as in a campaign run (else each
    is a fresh interpreter that imports torch). A job of ``nodes`` nodes (it may run on
    ``nodes_min``): this is node ``node`` (node 0 hosts the rendezvous at ``endpoint``); its output
    goes to ``node<node>.log``. ``first_round_wait``: seconds the first round waits for every node
    (default: the agent's)."""
    job_path = write_job(job)
    log = open(Path(job.job_dir) / f"node{node}.log", "ab")
    cmd = [
        sys.executable,
        "-m",
        "trainer.launch",
        str(job_path),
        "--nproc",
        str(nproc),
        "--rdzv-endpoint",
        endpoint or f"127.0.0.1:{free_port()}",
        "--run-id",
        run_id(job),
        "--max-restarts",
        str(max_restarts),
        "--node",
        str(node),
        "--nnodes-min",
        str(nodes if nodes_min is None else nodes_min),
        "--nnodes-max",
        str(nodes),
        "--node-timeout",
        str(node_timeout),
        *(["--first-round-wait", str(first_round_wait)] if first_round_wait is not None else []),
        *(["--rdzv-host"] if node == 0 else []),
        *(["--zygote", zygote.path] if zygote is not None else []),
    ]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **popen)


def node_log(job: JobConfig, nodes: int = 1) -> str:
    return "\n".join((Path(job.job_dir) / f"node{n}.log").read_text(errors="replace") for n in range(nodes))


def run_agent(
    job: JobConfig, timeout: float = 180, max_restarts: int = 0, nproc: int = 1, zygote: Zygote | None = None
) -> int:
    """Run the job's agent to its end; returns its exit code. Nothing it started outlives this
    (what it forked from ``zygote`` ends with it: the orphan watchdog)."""
    return run_agents(job, timeout, max_restarts, nproc, zygote)


def run_agents(
    job: JobConfig,
    timeout: float = 180,
    max_restarts: int = 0,
    nproc: int = 1,
    zygote: Zygote | None = None,
    nodes: int = 1,
    node_timeout: int = 3,
) -> int:
    """Run the job on ``nodes`` node agents (of ``nproc`` workers each) to its end; the largest of
    their exit codes. Nothing they started outlives this."""
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [
        start_agent(
            job,
            max_restarts,
            nproc,
            zygote,
            node=n,
            nodes=nodes,
            endpoint=endpoint,
            node_timeout=node_timeout,
            start_new_session=True,
        )
        for n in range(nodes)
    ]
    try:
        deadline = time.monotonic() + timeout
        return max(a.wait(max(0.0, deadline - time.monotonic())) for a in agents)
    finally:
        for agent in agents:
            try:
                os.killpg(agent.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def snapshot(ns: Path, step: int, rank: int = 0, world: int = 1, numel: int = 4) -> None:
    """A sealed snapshot of ``step`` flagged for persisting, as the node's only worker writes it
    (rank 0 holds the model: ``numel`` floats)."""
    store = SnapshotStore(ns, 0, rank, world, capacity=4 * numel + (1 << 20))
    state = {"rank": {"consumed": step, "step": step}}
    if rank == 0:
        state["shared"] = {"w": torch.full((numel,), float(step)), "step": step}
    store.snapshot(step, state, persist=True)
    store.flush()
