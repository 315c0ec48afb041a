"""A node agent's client of the job's store (the store the workers share across nodes: the
rendezvous store, or the round's own store hosted by rank 0 when the job has standby nodes), made
so that a store that went with its host, or a frozen host, is given up within seconds
(``trainer.agent.survivors`` then has no fast recovery: a full restart)."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from trainer.dist import listening

STORE_TIMEOUT_S = 5.0  # the job's store not answering by then: no fast recovery (a full restart)
# Connecting to it: a store that went with its host (the rank 0 worker of a round with standby
# nodes) refuses at once, but torch's client retries a refused connection until its timeout, and
# then again with a backoff (13 s with 5 s, while the survivors wait in a collective that failed).
CONNECT_TIMEOUT_S = 1.0
CONNECT_THREAD = "job-store-connect"  # the thread job_store_client makes its client in (left waiting on a frozen host)


def job_store_client(host: str, port: int) -> dist.TCPStore:
    """A client of the job's store at ``host:port``, or DistError/RuntimeError within a few
    seconds. A store that went with its host refuses at once (checked first: torch's client
    retries a refused connection). A frozen host (its process stopped) still accepts the
    connection in its kernel but never answers the client's handshake, for which torch waits for
    ever: the client is made in a thread given ``3 × CONNECT_TIMEOUT_S`` (a thread left waiting
    ends when the frozen host is stopped for good and its socket closes)."""
    if not listening(host, port, timeout_s=CONNECT_TIMEOUT_S):  # e.g. it went with the rank 0 that hosted it
        raise RuntimeError("nothing accepts a connection there")
    made: dict[str, object] = {}

    def connect() -> None:
        try:
            made["store"] = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=CONNECT_TIMEOUT_S))
        except (dist.DistError, RuntimeError) as err:
            made["error"] = err

    thread = threading.Thread(target=connect, name=CONNECT_THREAD, daemon=True)
    thread.start()
    thread.join(3 * CONNECT_TIMEOUT_S)
    if "error" in made:
        raise made["error"]
    if "store" not in made:
        raise RuntimeError(
            f"it accepted the connection but did not answer in {3 * CONNECT_TIMEOUT_S:.0f}s (its host is frozen?)"
        )
    store = made["store"]
    store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
    return store
