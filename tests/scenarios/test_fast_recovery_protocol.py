"""The parts of a fast recovery (test_fast_recovery.py) checked on their own, without a job:
which errors make a worker wait for a new epoch, the waits of its ranks (for a warm spare before a
drill, for the others to arrive), the round's restart count, a survivor's exit code, and how a
node agent reaches (or gives up) the job's store."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from pretrain.cluster.ports import free_port
from support.campaigns import wait_for
from trainer.dist import Identity, round_restart_count
from trainer.resilience.peers import (
    PEER_LOST_EXIT,
    CannotRejoin,
    Peers,
    arrive,
    arrive_as_replacement,
    exit_code,
    may_be_peer_loss,
    taken_key,
    warm_key,
)
from trainer.resilience.survivor_interrupt import PeerLost


@pytest.mark.parametrize(
    "err, candidate",
    [
        (
            RuntimeError(
                "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:12202: Connection reset"
            ),
            True,
        ),
        (
            RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms"),
            True,
        ),
        (torch.distributed.DistStoreError("wait timeout"), True),
        (PeerLost("a peer was lost: this step cannot complete"), True),  # the node agent interrupted the step
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),  # the worker's own error
        (ValueError("gloo"), False),
        (MemoryError(), False),
    ],
)
def test_only_a_broken_collective_makes_a_worker_wait_for_a_new_epoch(err, candidate):
    assert may_be_peer_loss(err) is candidate


def test_every_rank_goes_on_to_a_drill_once_its_victim_saw_a_warm_spare_on_its_own_node():
    """Before a drill takes a worker away, every rank waits until the victim saw a warm spare on
    its own node (another node's spare cannot take its rank). The victim's loss takes the spare at
    once: the others, who do not know the victim's node, follow the victim's word instead of
    looking for a spare that would only come after the recovery (CI: 30 s lost, then a full
    restart)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    other, victim = (Peers(store, Identity(r, 0, 2, 0, 0), "gloo", 10.0, node=r) for r in (0, 1))
    store.add(warm_key(0), 1)  # a spare on the other node only: the victim waits
    assert not other.wait_for_spare(lambda: None, drill=3, victim=False, timeout_s=0.2)
    assert victim.wait_for_spare(lambda: None, drill=3, victim=True, timeout_s=0.2)  # gave up: the drill goes on
    assert other.wait_for_spare(lambda: None, drill=3, victim=False, timeout_s=0.2)  # and so does everyone
    store.add(warm_key(1), 1)
    assert victim.wait_for_spare(lambda: None, drill=4, victim=True, timeout_s=5.0)
    store.add(taken_key(1), 1)  # the victim died; its agent handed its rank to the spare
    assert other.wait_for_spare(lambda: None, drill=4, victim=False, timeout_s=5.0)


def test_a_rank_that_never_arrives_ends_the_recovery_within_the_agents_bound():
    """A second loss during a fast recovery (the replacement's node, another survivor): the ranks
    that arrived give up after the agent's bound (then the fallback), instead of waiting in the
    new group's set-up for the process group's timeout (minutes)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    me = Identity(0, 0, 2, restart_count=1, epoch=1)
    t0 = time.monotonic()
    with pytest.raises(CannotRejoin, match="within 0.3 s"):
        arrive(store, me, 0.3)
    assert time.monotonic() - t0 < 5
    # rank 0 gave up and left: rank 1, arriving later, does not take it for arrived
    with pytest.raises(CannotRejoin):
        arrive(store, Identity(1, 0, 2, restart_count=1, epoch=1), 0.3)
    # the replacement of rank 1 arrives under the round's agreed restart count (a standby node's
    # agent counts fewer restarts): rank 0 meets it
    for rank, count in ((0, 1), (1, 0)):
        store.set(f"restart_count/{rank}", str(count))
    with ThreadPoolExecutor(1) as pool:
        other = dist.TCPStore("127.0.0.1", store.port, is_master=False)  # one client per process, as workers have
        survivor = pool.submit(arrive, other, me, 10.0)
        joined = arrive_as_replacement(store, Identity(1, 0, 2, restart_count=0, epoch=1), 10.0)
        survivor.result()
    assert joined.restart_count == 1


@pytest.mark.parametrize(
    "published, own, agreed",
    [
        ({}, 2, 2),  # agents sharing their store count alike: nothing published, this node's count
        ({0: "1"}, 0, 0),  # not every rank published: this node's count
        ({0: "1", 1: "0"}, 0, 1),  # a standby node's agent counted 0 restarts, the round agreed on 1
    ],
)
def test_the_restart_count_a_recovery_uses_is_the_rounds(published, own, agreed):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for rank, count in published.items():
        store.set(f"restart_count/{rank}", count)
    assert round_restart_count(store, 2, own) == agreed


@pytest.mark.parametrize(
    "err, fast, code",
    [
        (
            RuntimeError(
                "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:12202: Connection reset"
            ),
            True,
            PEER_LOST_EXIT,
        ),  # a survivor whose lost peer nobody replaces (its node is gone): not to be replaced itself
        (
            RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error"),
            False,
            1,
        ),  # survivors not kept
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), True, 1),  # the worker's own failure: replaced
    ],
)
def test_a_survivor_left_without_a_recovery_says_so_in_its_exit_code(err, fast, code):
    assert exit_code(err, fast) == code


def test_a_store_that_went_with_its_rank_0_is_given_up_at_once_not_after_torchs_connect_retries(monkeypatch, capfd):
    """The round of a job with standby nodes has its store in its rank 0 worker: when that node
    is lost and a local worker's exit is seen first (its collective failed), the agent looks for
    the store to recover fast. Torch's client retries a refused connection until its timeout and
    again after a backoff (13 s, found by a Kubernetes campaign test, the survivors stuck in the
    meantime); a store nothing listens at is given up without it (a full restart follows), and a
    live one is reached with the store timeout for its operations."""
    from trainer.agent.job_store import STORE_TIMEOUT_S
    from trainer.agent.survivors import SurvivorsAgent

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    live = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "TORCHELASTIC_USE_AGENT_STORE": "False"}
    agent = SimpleNamespace(_peers_store=None, _pcontext=object(), _store_retry_at=0.0)
    store = SurvivorsAgent._job_store(agent, live)
    store.set("k", "v")
    assert server.get("k") == b"v" and store.timeout.total_seconds() == STORE_TIMEOUT_S
    assert SurvivorsAgent._job_store(agent, live) is store  # one client per round

    gone = {**live, "MASTER_PORT": str(free_port())}
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **k: pytest.fail("a client was made for a store nobody serves"))
    asked = SimpleNamespace(_peers_store=None, _pcontext=object(), _store_retry_at=0.0)
    assert SurvivorsAgent._job_store(asked, gone) is None
    assert (
        f"no fast recovery: the job's store at 127.0.0.1:{gone['MASTER_PORT']} is not reachable"
        in capfd.readouterr().err
    )
    assert SurvivorsAgent._job_store(asked, gone) is None and capfd.readouterr().err == ""  # not asked again at once


FROZEN_STORE = """
import sys, threading
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
threading.Event().wait()
"""


def test_a_store_whose_host_is_frozen_is_given_up_not_waited_for_for_ever():
    """A frozen host's kernel still accepts connections but nothing answers torch's handshake,
    which waits for ever (an agent's look at its workers stuck for good, found by the Kubernetes
    frozen-pod test when the frozen pod's agent hosted the workers' store)."""
    from trainer.agent.job_store import CONNECT_THREAD, job_store_client

    host = subprocess.Popen([sys.executable, "-c", FROZEN_STORE], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        job_store_client("127.0.0.1", port).set("k", "v")  # answered while it runs
        host.send_signal(signal.SIGSTOP)
        with pytest.raises(RuntimeError, match="did not answer"):
            job_store_client("127.0.0.1", port)
    finally:
        host.kill()
        host.wait()
    # the client left waiting for the handshake ends once the host is gone for good (its last
    # words, torch's "Connection reset by peer", said here: after the test they reached the terminal)
    wait_for(
        lambda: not [t for t in threading.enumerate() if t.name == CONNECT_THREAD],
        30,
        "the abandoned connection attempt to end",
    )
