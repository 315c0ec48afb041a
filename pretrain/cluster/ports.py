"""Choosing a port for a listener that another process will open a moment later (a rendezvous
store, a node check's allreduce, a local API server).

A port the kernel hands out with ``bind(0)`` lies in the ephemeral range, the range it also
takes the local side of every outgoing connection from: between choosing it and the listener's
bind, any connection on the machine may take it (``EADDRINUSE``). On a busy machine (a test
suite, a node running other jobs) that happens. Ports are chosen below that range instead, where
only listeners live, and each one checked free.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
BELOW = 6000  # how far below the ephemeral range to look
TRIES = 200


def ephemeral_range(path: Path = RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range; Linux's default where it cannot be read (other systems)."""
    try:
        low, high = (int(x) for x in path.read_text().split()[:2])
        if 1024 < low <= high <= 65535:
            return low, high
    except (OSError, ValueError):
        pass
    return 32768, 60999


ANY = "0.0.0.0"  # a rendezvous store listens on every address: a port is free only if free on all


def bindable(port: int, host: str = ANY) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def _kernel_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port(span: int = 1, host: str = ANY, rng: random.Random | None = None) -> int:
    """A port P with P .. P+span-1 free, below the ephemeral range; the kernel's choice (span 1)
    if none is found there."""
    low, _ = ephemeral_range()
    rng = rng or random.Random()
    start = max(1024, low - BELOW)
    if low - span > start:
        for _ in range(TRIES):
            p = rng.randrange(start, low - span + 1)
            if all(bindable(p + i, host) for i in range(span)):
                return p
    if span == 1:
        return _kernel_port(host)
    raise OSError(f"no {span} consecutive free ports below {low}")
