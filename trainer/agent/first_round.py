"""The job's first rendezvous round waits for every node the job was launched with.

Torch's rendezvous closes a round ``last_call_timeout`` (5 s here, so that a round after a lost
node forms quickly) after ``min_nodes`` nodes joined. A node whose agent starts later than that
(a loaded machine, a pod whose image is still being pulled) misses the first round: the job starts
without it, and taking it in later costs every worker a restart (or, for a short job, the node is
never used at all). So before its first round each node's agent checks in at the rendezvous's
store and waits until all ``nodes`` agents did, or ``timeout_s`` passed (then the job starts with
those that came, as before, and the others join a later round). A node arriving after that (a
node joining a running job, one started again after a recheck) finds the count reached and goes
straight on.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch.distributed as dist

FIRST_ROUND_WAIT_S = 60.0  # default: how long the first round waits for late nodes


def _keys(run_id: str) -> tuple[str, str]:
    return f"pretrain/{run_id}/arrived", f"pretrain/{run_id}/all-arrived"


def _client(endpoint: str, timeout_s: float, connect_s: float = 30.0) -> dist.TCPStore:
    host, port = endpoint.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=max(timeout_s, connect_s)))


def checked_in(endpoint: str, run_id: str) -> int:
    """How many agents of job ``run_id`` checked in at the rendezvous store so far (0 while
    nobody hosts it)."""
    try:
        return _client(endpoint, 0.0, connect_s=5.0).add(_keys(run_id)[0], 0)
    except dist.DistNetworkError:
        return 0


def gather_nodes(endpoint: str, run_id: str, nodes: int, timeout_s: float, node: int = 0) -> int:
    """Check this agent in at the rendezvous store at ``endpoint`` (``host:port``; hosted by one
    node's rendezvous handler, which must exist already) and wait until ``nodes`` agents of job
    ``run_id`` did, at most ``timeout_s`` (0: check in only). Returns how many had checked in
    when it returned; says on stderr when it stopped waiting for some."""
    if nodes <= 1:
        return 1
    arrived_key, all_key = _keys(run_id)
    store = _client(endpoint, timeout_s)
    arrived = store.add(arrived_key, 1)
    print(
        f"{time.strftime('%H:%M:%S')} node {node}: checked in, {arrived} of the job's {nodes} nodes so far",
        file=sys.stderr,
        flush=True,
    )
    if arrived >= nodes:
        store.set(all_key, b"1")
        return arrived
    if timeout_s <= 0:
        return arrived
    started = time.monotonic()
    try:
        store.wait([all_key], timedelta(seconds=timeout_s))
    except dist.DistStoreError:
        arrived = store.add(arrived_key, 0)
        if arrived < nodes:
            print(
                f"node {node}: {arrived} of the job's {nodes} nodes started within {timeout_s:.0f} s; the job starts "
                "without the others (they join a later round when they come)",
                file=sys.stderr,
                flush=True,
            )
            return arrived
    waited = time.monotonic() - started
    if waited >= 5:
        print(f"node {node}: waited {waited:.0f} s for the job's other nodes to start", file=sys.stderr, flush=True)
    return nodes
