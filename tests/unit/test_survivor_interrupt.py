"""A survivor stops a step that cannot complete as soon as its node agent signals it
(``trainer.resilience.survivor_interrupt``), not when the step's collective fails at its end."""

from __future__ import annotations

import os
import signal
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from trainer.dist import Identity
from trainer.resilience.peers import Peers, announce
from trainer.resilience.survivor_interrupt import INTERRUPT_SIGNAL, Interrupt, PeerLost, interrupt


class Slow(torch.nn.Module):
    """A forward pass of many small layers that waits at layer 3 until the test let it go on."""

    def __init__(self, at_layer_3: threading.Event):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(8))
        self.at_layer_3 = at_layer_3

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i == 3:
                self.at_layer_3.wait(30)
            x = layer(x)
        return x


@pytest.fixture
def restore_handler():
    before = signal.getsignal(INTERRUPT_SIGNAL)
    yield
    signal.signal(INTERRUPT_SIGNAL, before)


def signalled_midway(model: Slow, go_on: threading.Event):
    """Run a forward and backward pass; the agent's signal arrives while it is at layer 3."""

    def agent():
        interrupt([os.getpid()])
        go_on.set()

    threading.Timer(0.05, agent).start()
    model(torch.ones(2, 4)).sum().backward()


def test_a_signalled_survivor_leaves_its_step_at_the_next_layer_once_the_recovery_is_announced(restore_handler):
    go_on = threading.Event()
    model = Slow(go_on)
    reached = []
    model.layers[4].register_forward_hook(lambda *a: reached.append(4))
    watch = Interrupt(lambda: True)
    watch.install(model)
    with pytest.raises(PeerLost):
        signalled_midway(model, go_on)
    assert reached == []  # left before layer 4: the rest of the forward and the backward were never computed
    assert watch.clear() is True and watch.clear() is False  # the rejoined event says how the loss was noticed


def test_a_signal_without_an_announcement_changes_nothing(restore_handler):
    """A stray or late signal (the survivor rejoined already): the step completes, and the signal
    is forgotten after the patience (so it cannot interrupt a later step)."""
    go_on, announced = threading.Event(), []
    model = Slow(go_on)
    watch = Interrupt(lambda: bool(announced), patience_s=0.0)
    watch.install(model)
    signalled_midway(model, go_on)  # completes
    assert all(p.grad is not None for p in model.parameters())
    assert watch.signalled_at is None
    announced.append(True)  # a recovery announced later, with no signal of its own: this step is not interrupted
    model(torch.ones(2, 4)).sum().backward()


def test_a_survivor_sees_its_agents_announcement_of_the_next_epoch_in_the_store():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    peers = Peers(store, Identity(0, 0, 2, 0, 0), "gloo", 10.0)
    assert not peers.next_epoch_announced()
    assert announce(store, 0, [1], "spare", 0.0) == 1
    assert peers.next_epoch_announced()
    peers.me = Identity(0, 0, 2, 0, 1)  # rejoined in epoch 1: the next recovery is epoch 2's, not announced
    assert not peers.next_epoch_announced()
