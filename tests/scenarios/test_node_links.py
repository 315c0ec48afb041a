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

from pretrain.cluster.ports import free_port
from support.campaigns import wait_for
from trainer.agent.node_links import LostNode, NodeLinks
from trainer.agent.rendezvous_close import EXPIRED, LOST_KEY, lost_from, record_lost

# a keep-alive every 60 s (unless told), a node dead after 3 missed: torch alone would take a killed node
# out after 120–180 s; the tests give the round 30 s
# (argv: endpoint, node number, min and max nodes, last call in s, slow_s: a survivor's agent on a
# loaded machine, this node leaves its round slow_s after it found a node lost, the last to leave, then
# takes slow_s more to join the next: meanwhile the rendezvous knows nothing of it; and the keep-alive
# interval in whole seconds: torch reads it as an int)
NODE = """
import json, select, sys, time
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import dynamic_rendezvous, registry
from trainer.agent.node_links import NodeLinks
from trainer.agent.torch_internals import fast_rendezvous_polls
from trainer.agent.rendezvous_store import RoundStoreAddress
from trainer.agent.torch_internals import record_expired_nodes
min_nodes, max_nodes, last_call, slow_s = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
params = RendezvousParameters(backend="c10d", endpoint=sys.argv[1], run_id="links", min_nodes=min_nodes,
                              max_nodes=max_nodes, join_timeout=60, last_call_timeout=last_call,
                              keep_alive_interval=int(sys.argv[7]), keep_alive_max_attempt=3)
fast_rendezvous_polls()  # as a node agent does: looks every 0.1 s,
record_expired_nodes()  # and records the nodes torch drops
join = dynamic_rendezvous._RendezvousJoinOp.__call__
def slow_join(op, ctx, deadline, slowed=[]):
    s = ctx.state
    if s.round > 0 and not s.complete and ctx.node not in s.participants and ctx.node not in s.wait_list and not slowed:
        slowed.append(time.sleep(slow_s))  # it left the last round and has not joined the next one yet
    return join(op, ctx, deadline)
dynamic_rendezvous._RendezvousJoinOp.__call__ = slow_join
rdzv = RoundStoreAddress(registry.get_rendezvous_handler(params), NodeLinks(node=int(sys.argv[2])))
info = rdzv.next_rendezvous()
print(json.dumps({"rank": info.rank, "world": info.world_size}), flush=True)
while True:
    while not select.select([sys.stdin], [], [], 0.05)[0]:  # as a node agent looks at its workers and links
        for lost in rdzv.links.take_lost():  # as the agent does: out of the rendezvous with it, and a new round
            print(json.dumps({"evicted": rdzv.evict(lost.desc), "node": lost.node}), flush=True)
            time.sleep(slow_s)
            info = rdzv.next_rendezvous()
            print(json.dumps({"rank": info.rank, "world": info.world_size}), flush=True)
        for silent in rdzv.take_expired():  # as the agent does (then it restarts its workers)
            print(json.dumps({"silent": silent.node, "rank": silent.rank}), flush=True)
    line = sys.stdin.readline().strip()
    if line == "finished":  # as the agent does before it waits for the others at the job's end
        rdzv.record_finished()
        print(json.dumps({"finished": True}), flush=True)
        continue
    if line == "look":  # a look for silent nodes now
        rdzv._next_expired_look = 0
        print(json.dumps({"looked": [n.node for n in rdzv.take_expired()]}), flush=True)
        continue
    if line != "again":  # "again": a new round, as the agent's restart after its workers' hang was found
        break
    info = rdzv.next_rendezvous()
    print(json.dumps({"rank": info.rank, "world": info.world_size}), flush=True)
if line == "bye":
    rdzv.links.close()
"""


ROUND_S = 30  # how long a round may take to form here


class Node(subprocess.Popen):
    """A node agent's rendezvous (``NODE``); its lines read with a bound."""

    def __init__(
        self,
        endpoint: str,
        number: int,
        nodes: tuple[int, int] = (2, 2),
        last_call_s: float = 1,
        slow_s: float = 0,
        keep_alive_s: int = 60,
    ):
        super().__init__(
            [
                sys.executable,
                "-c",
                NODE,
                endpoint,
                str(number),
                *map(str, nodes),
                str(last_call_s),
                str(slow_s),
                str(keep_alive_s),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
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
    host = TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False
    )  # as node 0's rendezvous handler hosts it
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
        joins = [
            threading.Thread(
                target=a.join_round,
                args=(
                    PrefixStore("round-0", TCPStore("127.0.0.1", port, is_master=False)),
                    rank,
                    4,
                    (f"node-{rank}", 10 + rank, 0),
                ),
            )
            for rank, a in enumerate(agents)
        ]
        for t in joins:
            t.start()
        for t in joins:
            t.join(30)
        wait_for(
            lambda: sum(len(a._accepted) for a in agents) == sum(len(a._watched) for a in agents),
            30,
            "every link held at both ends",
        )
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


LONG_LAST_CALL_S = 50  # longer than a round may take here (ROUND_S): a round that waits for it fails the test


def test_the_survivors_round_closes_once_every_other_node_is_back_not_after_the_last_call():
    """A job that may shrink (nodes_min 1 of 2) loses a node and has no standby: torch's round would
    wait its whole last call for late joiners; every node of the last round but the lost one is
    back at once, so the round closes then."""
    port = free_port()
    host = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    endpoint = f"127.0.0.1:{port}"
    a, b = (Node(endpoint, n, nodes=(1, 2), last_call_s=LONG_LAST_CALL_S) for n in range(2))
    try:
        assert sorted(r["world"] for r in formed([a, b])) == [2, 2]
        os.kill(b.pid, signal.SIGKILL)
        assert a.said() == {"evicted": True, "node": 1}
        assert a.said() == {"rank": 0, "world": 1}  # (within ROUND_S, far less than the last call)
    finally:
        for p in (a, b):
            p.kill()
    del host


def test_a_frozen_node_is_not_waited_for_once_its_keep_alives_lapsed():
    """A node whose sockets stay open (frozen here; a machine powered off, cut off) closes no link.
    Once its keep-alives lapse torch drops it, and the agent whose look did so records it: the
    survivor's next round (after its workers' hang was found) closes at once, not after the last
    call. The frozen node is the last round's rank 0, the one that would have closed it."""
    port = free_port()
    host = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    endpoint = f"127.0.0.1:{port}"
    nodes = [Node(endpoint, n, nodes=(1, 2), last_call_s=LONG_LAST_CALL_S, keep_alive_s=1) for n in range(2)]
    try:
        ranks = [r["rank"] for r in formed(nodes)]
        frozen, survivor = nodes[ranks.index(0)], nodes[ranks.index(1)]
        os.kill(frozen.pid, signal.SIGSTOP)
        wait_for(lambda: lost_from(host, EXPIRED), ROUND_S, "the frozen node recorded dropped")
        [(_, pid, _)] = lost_from(host, EXPIRED)  # its rendezvous identity: host, agent process, local id
        assert pid == frozen.pid
        survivor.tell("again")
        said = survivor.said()
        if (
            "silent" in said
        ):  # the survivor's own look dropped it (not the frozen node's peers'): it says so, as an agent does
            assert said == {"silent": ranks.index(0), "rank": 0}
            said = survivor.said()
        assert said == {"rank": 0, "world": 1}  # (within ROUND_S, far less than the last call)
    finally:
        for p in nodes:
            p.kill()


def test_a_silent_node_of_the_round_is_reported_once_but_not_one_that_finished_the_job():
    """Two of three nodes stop sending keep-alives: one frozen, one that finished the job and waits
    for the others (torch's exit barrier). The third reports the frozen one alone, once."""
    port = free_port()
    host = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    endpoint = f"127.0.0.1:{port}"
    nodes = [Node(endpoint, n, nodes=(1, 3), last_call_s=LONG_LAST_CALL_S, keep_alive_s=1) for n in range(3)]
    survivor, finished, frozen = nodes
    try:
        ranks = {n: r["rank"] for n, r in enumerate(formed(nodes))}
        finished.tell("finished")
        assert finished.said() == {"finished": True}
        for node in (finished, frozen):
            os.kill(node.pid, signal.SIGSTOP)
        assert survivor.said() == {"silent": 2, "rank": ranks[2]}
        wait_for(lambda: len(lost_from(host, EXPIRED)) == 2, ROUND_S, "both nodes dropped by the rendezvous")
        survivor.tell("look")
        assert survivor.said() == {"looked": []}  # the frozen one reported already; the finished one never
    finally:
        for p in nodes:
            p.kill()


def test_a_survivor_slow_to_rejoin_is_waited_for_though_every_node_the_rendezvous_knows_is_in():
    """Three nodes, one lost: the other two each find it and re-form. One of them is slow between
    leaving the last round and joining the next (the rendezvous knows nothing of it meanwhile): the
    round still waits for it, instead of closing with the first survivor alone."""
    port = free_port()
    host = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    endpoint = f"127.0.0.1:{port}"
    nodes = [Node(endpoint, n, nodes=(1, 3), last_call_s=LONG_LAST_CALL_S, slow_s=2 if n == 1 else 0) for n in range(3)]
    a, b, c = nodes
    try:
        assert sorted(r["world"] for r in formed(nodes)) == [3, 3, 3]
        os.kill(c.pid, signal.SIGKILL)
        assert a.said() == b.said() == {"evicted": True, "node": 2}
        assert sorted((r["rank"], r["world"]) for r in formed([a, b])) == [(0, 2), (1, 2)]
    finally:
        for p in nodes:
            p.kill()
    del host


def test_the_lost_nodes_of_a_round_are_read_back_and_a_damaged_record_is_skipped():
    """A record that cannot be read (being written, damaged by hand) only means that node is waited
    for (torch's last call): never a failed rendezvous."""
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    record_lost(store, 3, ("node-a", 11, 0))
    record_lost(store, 3, ("node-b", 12, 0))
    record_lost(store, 4, ("node-c", 13, 0))
    store.set(f"{LOST_KEY}/3/1", "[not json")
    store.add(f"{LOST_KEY}/3/count", 1)  # a record counted and never written
    assert lost_from(store, 3) == {("node-a", 11, 0)}
    assert lost_from(store, 4) == {("node-c", 13, 0)} and lost_from(store, 5) == set()
