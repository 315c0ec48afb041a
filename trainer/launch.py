"""Node agent: ``python -m trainer.launch JOB.json --nproc N ...`` (the agent itself:
``trainer.agent.node``).

Runs torch's elastic agent for one node and starts ``python -m trainer.worker JOB.json`` per
local rank; exits 0 when every worker finished, 1 when the job failed after its restarts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.agent.first_round import FIRST_ROUND_WAIT_S
from trainer.agent.node import run_node
from trainer.common.process import exit_now


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.launch")
    p.add_argument("job", help="job config JSON")
    p.add_argument("--nproc", type=int, required=True, help="workers on this node")
    p.add_argument("--nnodes-min", type=int, default=1)
    p.add_argument("--nnodes-max", type=int, default=1)
    p.add_argument("--rdzv-endpoint", required=True, help="host:port of the c10d rendezvous")
    p.add_argument("--run-id", required=True, help="rendezvous id shared by the job's nodes")
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--lock", type=Path, help="file locked for the agent's lifetime")
    p.add_argument(
        "--lock-wait",
        type=float,
        help="seconds to wait for a dying predecessor to let go of --lock (PRETRAIN_NODE_LOCK_WAIT_S)",
    )
    p.add_argument("--threads", type=int, default=1, help="OMP threads per worker")
    p.add_argument("--node", type=int, default=0, help="this node's index in the cluster (chaos drills, logs)")
    p.add_argument(
        "--zygote",
        help="the campaign run's fork server (trainer.zygote.client): the agent forks its workers, "
        "spares and saver from it, torch imported; without it they are fresh interpreters",
    )
    p.add_argument("--rdzv-host", action="store_true", help="this node hosts the rendezvous store (exactly one node)")
    p.add_argument(
        "--standby",
        action="store_true",
        help="a standby node: joins the rendezvous once training runs and "
        "waits there until a node is lost (a job of several nodes)",
    )
    p.add_argument(
        "--node-timeout",
        type=int,
        default=3,
        help="seconds without a keep-alive after which the rendezvous drops a node (a job of several nodes)",
    )
    p.add_argument(
        "--first-round-wait",
        type=float,
        default=FIRST_ROUND_WAIT_S,
        help="seconds the job's first rendezvous round waits for all --nnodes-max nodes to start "
        "(a job of several nodes; 0: only torch's last call)",
    )
    args = p.parse_args(argv)
    if args.lock and args.lock_wait is None:
        p.error("--lock needs --lock-wait")
    return args


def main(argv: list[str] | None = None) -> int:
    return run_node(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    exit_now(main())  # whoever started it waits for the exit: no module teardown
