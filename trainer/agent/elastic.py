"""A job of several nodes: torch's elastic agent (c10d rendezvous, worker monitoring, in-job
restarts; the survivors of a lost worker kept, ``trainer.agent.survivors``) on each node, and
*standby* nodes (``cluster.spare_nodes``).

A standby node's agent waits until the job's workers start, then joins the job's rendezvous. The round
is full (``max_nodes`` is the number of nodes in use), so torch keeps it in its redundancy list,
sending keep-alives, torch imported and its saver started. When a node is lost, the survivors'
next round takes the standby in its place as soon as the lost node's keep-alives have lapsed
(``cluster.node_timeout_s``): the world keeps its size and global batch, and the round
completes at once (a full round needs no last-call wait).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from trainer.agent.elastic_launch import launch
from trainer.agent.torch_internals import (
    fast_rendezvous_polls,
    record_expired_nodes,
    stand_by_when_round_full,
    unverified_torch,
)
from trainer.common.process import PARENT_ENV
from trainer.dist import FAST_RECOVERY_ENV, listening
from trainer.job.config import JobConfig
from trainer.job.events import EventKind
from trainer.job.layout import JobLayout
from trainer.job.reporting import JsonLines, read_all
from trainer.resilience.heartbeat import AGENT_ENV, heartbeat_dir
from trainer.resilience.nodecheck import NODE_ENV
from trainer.resilience.peers import NOTICE_ENV, WARM_SPARES_ENV, notice_for_nodes
from trainer.zygote.client import Zygote

ENV_COMMAND = "/usr/bin/env"  # POSIX: runs a command with variables added to its environment (it execs it)
STANDBY_NEVER_UP_S = 300.0  # a standby whose job's rendezvous never listened by then leaves (the job failed to start)


def elastic_worker_command(zygote: Zygote | None, worker_args: list[str], env: dict[str, str]) -> list[str]:
    """The worker's whole command line for torch's elastic agent, ``env`` added to the worker's
    environment (never to the agent's): forked from the zygote through ``trainer.zygote_exec``
    when there is one (no ``import torch`` at the job's start and at every restart); else
    ``python -u -m trainer.worker …`` in a fresh interpreter, started through ``env``."""
    if zygote is None or not zygote.usable:  # (env execs python: this agent is its parent, named for its watchdog)
        env = {**env, PARENT_ENV: str(os.getpid())}
        return [ENV_COMMAND, *(f"{k}={v}" for k, v in env.items()), sys.executable, *worker_args]
    env = {**env, AGENT_ENV: str(os.getpid())}  # its heartbeats name this agent, not the zygote (its parent)
    return [
        sys.executable,
        "-m",
        "trainer.zygote_exec",
        "--zygote",
        zygote.path,
        "--unbuffered",
        *(a for k, v in env.items() for a in ("--env", f"{k}={v}")),
        "trainer.worker",
        *worker_args[3:],
    ]


def rendezvous_configs(args: argparse.Namespace) -> dict:
    """A lost node leaves the rendezvous after ``--node-timeout`` seconds of missed keep-alives (one
    a second); a round waits 5 s for late joiners beyond nodes_min (all nodes start together, so
    the first round gathers every healthy node; a full round completes at once); a node joining
    later makes the agents restart to take it in."""
    return {
        "timeout": 120,
        "join_timeout": 600,
        "last_call_timeout": 5,
        "keep_alive_interval": 1,
        "keep_alive_max_attempt": args.node_timeout,
        "is_host": args.rdzv_host,
    }


def first_round_formed(job_dir: str | Path) -> bool:
    """Whether the job's nodes formed their first round: a worker of it started (its heartbeat
    file exists, however short it lived)."""
    return any(heartbeat_dir(job_dir).glob("agent*-local*.json"))


def wait_to_stand_by(
    job_dir: str | Path, endpoint: str, poll_s: float = 0.1, never_up_s: float = STANDBY_NEVER_UP_S
) -> bool:
    """A standby node joins once the job's own nodes formed their first round (True), so that it
    stands by instead of taking one of their places. False: the job's rendezvous went away first
    (the job ended or failed before it started training), or never listened within ``never_up_s``.
    A rendezvous not listening *yet* is not gone: on a loaded machine the standby may start
    before the first node's agent (torch's import takes seconds) hosts it."""
    checks, seen, deadline = 0, False, time.monotonic() + never_up_s
    while not first_round_formed(job_dir):
        checks += 1
        if checks % 5 == 0:
            up = listening(*host_port(endpoint))
            if (seen and not up) or (not seen and not up and time.monotonic() > deadline):
                return False
            seen = seen or up
        time.sleep(poll_s)  # polls for the workers' heartbeat files and, every 5th time, the rendezvous
    return True


def host_port(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.rsplit(":", 1)
    return host, int(port)


def ran_workers(job_dir: str | Path, node: int) -> bool:
    """Whether a worker of this node started in the job (its ``start`` event names the node)."""
    return any(
        e.get("event") == EventKind.START and e.get("node") == node for e in read_all(JobLayout.of(job_dir).events)
    )


def _terminate(signum, frame) -> None:
    raise SignalException(f"agent {os.getpid()} got signal {signal.Signals(signum).name}", signal.Signals(signum))


def run_elastic(
    args: argparse.Namespace,
    job: JobConfig,
    zygote: Zygote | None,
    worker_args: list[str],
    fast_timeout_s: float = 0.0,
    spares_wanted=lambda: True,
    before_round=lambda: None,
) -> int:
    """Torch's elastic agent for this node of a job of several nodes (``args``: ``trainer.launch``'s),
    keeping the survivors of a lost worker when ``fast_timeout_s`` > 0 (``trainer.agent.survivors``),
    and ``job.cluster.spares_per_node`` warm spares once ``spares_wanted()``; ``before_round()`` runs before this
    node joins each rendezvous round."""
    spares = job.cluster.spares_per_node if fast_timeout_s > 0 else 0
    signal.signal(signal.SIGTERM, _terminate)  # until torch's agent installs its own: the same exception
    command = elastic_worker_command(zygote, worker_args, _worker_env(args, fast_timeout_s, spares))
    if args.standby and (code := _stand_by(args, job)) is not None:
        return code
    _patch_torch(args, job)
    return _run_node(args, job, command, fast_timeout_s, spares, spares_wanted, before_round)


def _worker_env(args: argparse.Namespace, fast_timeout_s: float, spares: int) -> dict[str, str]:
    """What the agent adds to each worker's environment."""
    return {
        "OMP_NUM_THREADS": str(args.threads),
        NODE_ENV: str(args.node),  # workers name their node (node check, events)
        FAST_RECOVERY_ENV: str(fast_timeout_s),
        WARM_SPARES_ENV: str(spares),
        # a lost node announces no epoch: its survivors leave for the full restart once its keep-alives lapse
        NOTICE_ENV: str(notice_for_nodes(args.node_timeout)),
    }


def _stand_by(args: argparse.Namespace, job: JobConfig) -> int | None:
    """A standby node's wait for the job's first round (``wait_to_stand_by``): None once it may
    join; else this node's exit code (the job ended first, or a signal stopped it)."""
    try:
        if not wait_to_stand_by(job.job_dir, args.rdzv_endpoint):
            print(f"standby node {args.node}: the job ended before training started", file=sys.stderr, flush=True)
            return 0
    except SignalException as err:
        print(
            f"standby node {args.node}: stopped by {err.sigval.name} before it was needed", file=sys.stderr, flush=True
        )
        return 128 + err.sigval
    return None


def _patch_torch(args: argparse.Namespace, job: JobConfig) -> None:
    """Torch's private internals patched in this agent's process (``trainer.agent.torch_internals``),
    said when the installed torch is not the one they were verified with; a node the rendezvous
    drops for its lapsed keep-alives is recorded in the job's events."""
    if (unverified := unverified_torch()) is not None:
        print(f"node {args.node}: {unverified}", file=sys.stderr, flush=True)
    fast_rendezvous_polls()
    stand_by_when_round_full()
    events = JsonLines(job.layout.events)
    record_expired_nodes(
        on_expired=lambda desc: events.write(
            {
                "event": EventKind.NODE_LOST,
                "source": "rendezvous",
                "agent_node": args.node,
                "standby": False,
                "identity": ":".join(map(str, desc)),
                "reason": f"no keep-alive for {args.node_timeout}s",
            }
        )
    )


def _run_node(
    args: argparse.Namespace,
    job: JobConfig,
    command: list[str],
    fast_timeout_s: float,
    spares: int,
    spares_wanted,
    before_round,
) -> int:
    """This node's part of the job (``trainer.agent.elastic_launch.launch``) until the job ends:
    the node agent's exit code (0: the job succeeded, or ended while this node stood by)."""
    try:
        trained = launch(
            min_nodes=args.nnodes_min,
            max_nodes=args.nnodes_max,
            nproc=args.nproc,
            run_id=args.run_id,
            endpoint=args.rdzv_endpoint,
            rdzv_configs=rendezvous_configs(args),
            max_restarts=args.max_restarts,
            command=command,
            fast_timeout_s=fast_timeout_s,
            spares=spares,
            node=args.node,
            spares_wanted=spares_wanted,
            before_round=before_round,
            first_round_wait_s=None if args.standby else args.first_round_wait,
        )
    except ChildFailedError as err:
        print(f"training job failed: {err.format_msg()}", file=sys.stderr, flush=True)
        return 1
    except SignalException as err:
        print(f"stopped by {err.sigval.name}", file=sys.stderr, flush=True)
        return 128 + err.sigval
    except Exception as err:  # noqa: BLE001 - a standby whose job ended: torch fails on the closed rendezvous
        if args.standby and not ran_workers(job.job_dir, args.node):
            print(
                f"standby node {args.node}: the job ended without needing it ({type(err).__name__})",
                file=sys.stderr,
                flush=True,
            )
            return 0
        raise
    if not trained:  # the rendezvous closed while this node stood by
        print(
            f"standby node {args.node}: the job ended without needing it"
            if args.standby and not ran_workers(job.job_dir, args.node)
            else f"node {args.node}: the job ended while this node stood by (its place taken in a later round)",
            file=sys.stderr,
            flush=True,
        )
    return 0
