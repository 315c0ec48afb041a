"""A lost node found as its agent's process goes away, not once its keep-alives have lapsed.

Torch's rendezvous takes a node out of a round only when it missed ``node_timeout_s`` of
keep-alives (one a second): until then a standby node cannot take the lost node's place, and the
survivors wait for an announcement a lost node never makes (``peers.NOTICE_ENV``). A node is
usually lost because its agent's process died (killed, its pod deleted, out of memory), and a
process that dies closes its sockets at once. So each node agent of a round holds a TCP
connection to each of the next ``WATCHED`` ranks (the round's ranks in a ring: 2N connections for
N nodes, not N²): a connection closed without a goodbye means that agent is gone, and its
watcher reports it (``take_lost``) for the agent to take the node out of the rendezvous and tell
the survivors to leave for the next round at once. Nodes lost together — a drained machine's
pods, a rack's power — often hold consecutive ranks: two in a row are both found by the rank
before them. A node cut off with its sockets left open (a machine powered off, a network
partition) is still found by torch's keep-alives; so is the third of three neighbours lost
together (its watchers went with it).
"""

from __future__ import annotations

import json
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta

import torch.distributed as dist

LINKS_KEY = (
    "pretrain/links"  # + /<rank>: where a round's node agent listens, in the round's part of the rendezvous store
)
LINK_WAIT_S = (
    5.0  # how long an agent waits for the watched ranks' addresses (published as its round forms) and to connect
)
WATCHED = (
    2  # how many of the next ranks each agent watches: every lost node is found unless more than this many in a row go
)
BYE = b"B"  # sent before an agent closes its links on purpose (the job ended): not a loss


@dataclass(frozen=True)
class LostNode:
    rank: int  # its rank in the round
    node: int  # the job's node number (its agent's ``--node``)
    desc: tuple | None  # its rendezvous identity (torch's node descriptor: addr, pid, local id), None if unknown
    at: float  # when its connection closed (epoch seconds)
    silent: bool = (
        False  # found by the rendezvous (its keep-alives lapsed), not by a closed link: its sockets may be open
    )


class NodeLinks:
    """This agent's end of the ring: a listener the previous ranks connect to, a connection to each
    of the next ``watched`` ranks, each watched by a thread."""

    def __init__(self, node: int = 0, watched: int = WATCHED):
        self.node = node
        self.watched = watched
        self._listener: socket.socket | None = None
        self._accepted: list[socket.socket] = []
        self._watched: list[socket.socket] = []
        self._lost: list[LostNode] = []
        self._lock = threading.Lock()

    def join_round(self, store: dist.Store, rank: int, world_size: int, desc: tuple | None) -> None:
        """After a round formed: publish where this agent listens (``store``: the round's part of
        the rendezvous store) and watch the agents of the next ``watched`` ranks (fewer in a
        smaller round). Without a link (that rank never published, or could not be reached), that
        node's loss is left to the keep-alives. A loss found in the last round and not taken yet is
        dropped: this round formed without it."""
        self._unwatch()
        self.take_lost()
        if world_size < 2:
            return
        try:
            host, port = self._serve()
            store.set(
                f"{LINKS_KEY}/{rank}",
                json.dumps({"host": host, "port": port, "node": self.node, "desc": list(desc) if desc else None}),
            )
        except (dist.DistError, OSError) as err:
            print(
                f"no links to the other agents: their loss will be found by the rendezvous's keep-alives "
                f"({type(err).__name__}: {err})",
                file=sys.stderr,
                flush=True,
            )
            return
        deadline = time.monotonic() + LINK_WAIT_S  # for all the links together: the round's workers wait for them
        for ahead in range(1, min(self.watched, world_size - 1) + 1):
            self._link((rank + ahead) % world_size, store, deadline)

    def _link(self, nxt: int, store: dist.Store, deadline: float) -> None:
        """Connect to the agent of the round's rank ``nxt`` and watch the connection in a thread."""
        try:
            store.wait([f"{LINKS_KEY}/{nxt}"], timedelta(seconds=max(0.1, deadline - time.monotonic())))
            peer = json.loads(store.get(f"{LINKS_KEY}/{nxt}"))
            sock = socket.create_connection(
                (peer["host"], int(peer["port"])), timeout=max(0.1, deadline - time.monotonic())
            )
        except (dist.DistError, OSError, ValueError, KeyError, TypeError) as err:
            print(
                f"no link to the agent of rank {nxt}: its loss will be found by the rendezvous's keep-alives "
                f"({type(err).__name__}: {err})",
                file=sys.stderr,
                flush=True,
            )
            return
        sock.settimeout(None)
        self._watched.append(sock)
        lost = LostNode(nxt, int(peer.get("node", nxt)), tuple(peer["desc"]) if peer.get("desc") else None, 0.0)
        threading.Thread(target=self._watch, args=(sock, lost), name="node-link", daemon=True).start()

    def take_lost(self) -> list[LostNode]:
        """The nodes found gone since the last call."""
        with self._lock:
            lost, self._lost = self._lost, []
        return lost

    def close(self) -> None:
        """The job ended here: say goodbye to the agents watching this one, so that they do not
        take this agent's exit for a loss."""
        self._unwatch()
        with self._lock:  # a connection accepted from here on is answered by _accept with a goodbye
            accepted, self._accepted = self._accepted, []
            listener, self._listener = self._listener, None
        for sock in accepted:
            _say_bye(sock)
        if listener is not None:
            listener.close()

    def _serve(self) -> tuple[str, int]:
        """Where this agent listens: at its host name, as torch's rendezvous names the node (the
        address the other nodes reach its store at)."""
        host = socket.getfqdn()
        if self._listener is None:
            self._listener = socket.create_server((host, 0))
            threading.Thread(target=self._accept, args=(self._listener,), name="node-links", daemon=True).start()
        return host, self._listener.getsockname()[1]

    def _accept(self, listener: socket.socket) -> None:
        """Holds the connections of the agents watching this one (they never send anything; one
        that closed is let go when the next one comes)."""
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:  # closed: the job ended
                return
            with self._lock:
                if listener is not self._listener:  # accepted as the job ended here (close took the others)
                    _say_bye(sock)
                    return
                gone = select.select(self._accepted, [], [], 0)[0] if self._accepted else []
                for old in gone:  # readable means closed: a watcher that moved to a new round
                    old.close()
                self._accepted = [s for s in self._accepted if s not in gone] + [sock]

    def _watch(self, sock: socket.socket, lost: LostNode) -> None:
        try:
            data = sock.recv(1)
        except OSError:
            data = b""
        if (
            all(sock is not w for w in self._watched) or data == BYE
        ):  # let go on purpose (a new round), or the job ended there
            return
        with self._lock:
            self._lost.append(replace(lost, at=time.time()))

    def _unwatch(self) -> None:
        socks, self._watched = self._watched, []
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes its watcher, which sees it is no longer the one watched
            except OSError:
                pass
            sock.close()


def _say_bye(sock: socket.socket) -> None:
    try:
        sock.sendall(BYE)
    except OSError:
        pass
    sock.close()
