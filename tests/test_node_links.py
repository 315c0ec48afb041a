"""A node whose agent process dies is found at once by its neighbour's link and taken out of
torch's rendezvous, so that a standby takes its place without waiting for its keep-alives to
lapse; an agent that ends on purpose says goodbye and is not taken for lost."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading

from torch.distributed import PrefixStore, TCPStore

from conftest import wait_for
from pretrain.ports import free_port
from trainer.node_links import LostNode, NodeLinks

# a keep-alive every 60 s, a node dead after 3 missed: torch alone would take a killed node out
# after 120–180 s; the tests give the round 30 s
NODE = """
import json, select, sys
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry
from trainer.node_links import NodeLinks
from trainer.rendezvous_store import RoundStoreAddress
params = RendezvousParameters(backend="c10d", endpoint=sys.argv[1], run_id="links", min_nodes=2, max_nodes=2,
                              join_timeout=60, last_call_timeout=1, keep_alive_interval=60, keep_alive_max_attempt=3)
rdzv = RoundStoreAddress(registry.get_rendezvous_handler(params), NodeLinks(node=int(sys.argv[2])))
info = rdzv.next_rendezvous()
print(json.dumps({"rank": info.rank, "world": info.world_size}), flush=True)
while not select.select([sys.stdin], [], [], 0.05)[0]:  # as a node agent looks at its workers and links
    for lost in rdzv.links.take_lost():  # as the agent does: out of the rendezvous with it, and a new round
        print(json.dumps({"evicted": rdzv.evict(lost.desc), "node": lost.node}), flush=True)
        info = rdzv.next_rendezvous()
        print(json.dumps({"rank": info.rank, "world": info.world_size}), flush=True)
if sys.stdin.readline().strip() == "bye":
    rdzv.links.close()
"""


ROUND_S = 30  # how long a round may take to form here


class Node(subprocess.Popen):
    """A node agent's rendezvous (``NODE``); its lines read with a bound."""

    def __init__(self, endpoint: str, number: int):
        super().__init__([sys.executable, "-c", NODE, endpoint, str(number)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.stdout], daemon=True).start()

    def said(self) -> dict:
        try:
            return json.loads(self.lines.get(timeout=ROUND_S))
        except queue.Empty:
            raise AssertionError(f"node said nothing within {ROUND_S} s (exit code {self.poll()})") from None

    def tell(self, line: str) -> None:
        self.stdin.write(line + "\n")
        self.stdin.flush()


def formed(nodes: list[Node]) -> list[dict]:
    return [n.said() for n in nodes]


def watchers_done() -> bool:
    return not any(t.name == "node-link" and t.is_alive() for t in threading.enumerate())


def test_a_killed_nodes_place_goes_to_a_standby_at_once_and_a_node_saying_goodbye_is_not_lost():
    port = free_port()
    host = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # as node 0's rendezvous handler hosts it
    endpoint = f"127.0.0.1:{port}"
    a, b = Node(endpoint, 0), Node(endpoint, 1)
    standby = None
    try:
        assert sorted(r["rank"] for r in formed([a, b])) == [0, 1]
        standby = Node(endpoint, 2)  # the round is full: it stands by
        os.kill(b.pid, signal.SIGKILL)
        b.wait()
        # a (the survivor) takes b out through its link, leaves its round and meets the standby in the next
        assert a.said() == {"evicted": True, "node": 1}
        assert sorted(r["rank"] for r in formed([a, standby])) == [0, 1]
        a.tell("bye")
        standby.tell("")  # ends without goodbye
        assert a.wait(30) == 0 and standby.wait(30) == 0
    finally:
        for p in (a, b, standby):
            if p is not None and p.poll() is None:
                p.kill()
    del host


def killed(links: NodeLinks) -> None:
    """What a killed agent's process does to its links: every socket closed, no goodbye."""
    links._listener.close()
    for sock in links._accepted + links._watched:
        sock.close()


def test_the_survivors_link_reports_the_lost_node_with_its_rendezvous_identity():
    port = free_port()
    host = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)

    def round_store(prefix: str) -> PrefixStore:  # each agent has its own client (a waiting one blocks its client)
        return PrefixStore(prefix, TCPStore("127.0.0.1", port, is_master=False))

    mine = NodeLinks(node=0)
    try:
        theirs = NodeLinks(node=1)
        joined = threading.Thread(target=theirs.join_round, args=(round_store("round-0"), 1, 2, ("node-b", 7, 1)))
        joined.start()
        mine.join_round(round_store("round-0"), 0, 2, ("node-a", 5, 0))
        joined.join(30)
        assert mine.take_lost() == [] and theirs.take_lost() == []
        theirs.close()  # node 1's agent ends the job: it says goodbye
        wait_for(watchers_done, 30, "my link's watcher sees the goodbye")
        assert mine.take_lost() == []

        theirs = NodeLinks(node=1)
        joined = threading.Thread(target=theirs.join_round, args=(round_store("round-1"), 1, 2, ("node-b", 7, 2)))
        joined.start()
        mine.join_round(round_store("round-1"), 0, 2, ("node-a", 5, 0))
        joined.join(30)
        wait_for(lambda: theirs._accepted, 30, "their agent holds my link")  # accepted in a thread of its own
        killed(theirs)
        lost = wait_for(mine.take_lost, 30, "the lost node reported")
        assert [(n.rank, n.node, n.desc) for n in lost] == [(1, 1, ("node-b", 7, 2))]
        assert isinstance(lost[0], LostNode) and lost[0].at > 0
    finally:
        mine.close()
    del host


def test_two_neighbours_lost_together_are_both_reported_by_the_rank_before_them():
    """Nodes lost together (a drained machine's pods, a rack) often hold consecutive ranks: the
    rank before them watches both, so neither waits for its keep-alives to lapse."""
    port = free_port()
    host = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    agents = [NodeLinks(node=n) for n in range(4)]
    try:
        joins = [threading.Thread(target=a.join_round,
                                  args=(PrefixStore("round-0", TCPStore("127.0.0.1", port, is_master=False)), rank, 4,
                                        (f"node-{rank}", 10 + rank, 0)))
                 for rank, a in enumerate(agents)]
        for t in joins:
            t.start()
        for t in joins:
            t.join(30)
        wait_for(lambda: sum(len(a._accepted) for a in agents) == sum(len(a._watched) for a in agents), 30,
                   "every link held at both ends")
        killed(agents[1])
        killed(agents[2])
        lost: list[LostNode] = []
        wait_for(lambda: lost.extend(agents[0].take_lost()) or len(lost) == 2, 30, "both lost nodes reported")
        assert sorted((n.rank, n.desc) for n in lost) == [(1, ("node-1", 11, 0)), (2, ("node-2", 12, 0))]
        # the rank after them watches 0 and 1: it finds rank 1 too (the agents' evictions agree)
        assert [n.rank for n in wait_for(agents[3].take_lost, 30, "rank 3 reports rank 1")] == [1]
    finally:
        for a in agents:
            a.close()
    del host
