"""Survivors stop a doomed step at once: the agent that saw a worker die signals the others.

Without it a survivor learns of a lost peer only when its step's collective fails: under DDP at
the end of its backward pass, after computing a step that cannot complete (most of a step's
time: ~200 of 300 ms in the recovery bench with ``--d-model 384 --layers 6``). Under NCCL the
hooks run while the CPU queues the step's kernels, so they stop only what is not queued yet: a
survivor already waiting on the GPU waits for its collective's timeout as before. The
node agent sends ``INTERRUPT_SIGNAL`` to the workers it keeps right after announcing the
recovery; each survivor's handler only notes the time, and hooks on its model (before the
forward of each block, at the gradient of each block's first parameter: points between whole
operations of the step, where nothing is half-updated) raise ``PeerLost`` once the announcement
is in the store. The step's partial work is dropped as a failed collective's would be; the optimizer and
the data position are untouched (both change only after the step's collectives).

A signal with no announcement behind it (sent late, after the survivor already rejoined, or by
someone else) changes nothing: it is dropped after ``PATIENCE_S``. ``SIGURG`` is ignored by
default, so a process that has not installed the handler yet (a spare, a worker starting) is
unharmed by it.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterable

import torch

from trainer.common.process import signal_process

INTERRUPT_SIGNAL = signal.SIGURG
PATIENCE_S = 1.0  # how long a signal waits for its announcement before it is taken for a stray one


class PeerLost(RuntimeError):
    """Raised inside a survivor's step once its agent announced a lost peer (a failed collective's stand-in)."""


def interrupt(pids: Iterable[int]) -> None:
    """The agent's side: tell the kept workers ``pids`` that their current step cannot complete."""
    for pid in pids:
        signal_process(pid, INTERRUPT_SIGNAL)


class Interrupt:
    """A survivor's side: ``install`` the handler and the hooks; ``clear`` once it rejoined."""

    def __init__(self, announced: Callable[[], bool], patience_s: float = PATIENCE_S):
        self.announced = announced  # whether the agent announced the next recovery (one look at the store)
        self.patience_s = patience_s
        self.signalled_at: float | None = None
        self.fired = (
            False  # whether the last PeerLost came from here (the rejoined event says how the loss was noticed)
        )

    def install(self, model) -> list:
        """Handle ``INTERRUPT_SIGNAL`` in this (the main) thread and check before the forward of
        ``model`` and of each of its blocks (the entries of its ``ModuleList``s), and at the
        gradient of each one's first parameter (a hook on every module and parameter cost ~2 %
        of a step of the recovery bench's model; these cost nothing measurable); returns the
        hooks' handles."""
        signal.signal(INTERRUPT_SIGNAL, self._on_signal)
        blocks = [model] + [m for ml in model.modules() if isinstance(ml, torch.nn.ModuleList) for m in ml]
        firsts = [p for p in (next(m.parameters(), None) for m in blocks) if p is not None and p.requires_grad]
        return [m.register_forward_pre_hook(self._check_forward) for m in blocks] + [
            p.register_hook(self._check_grad) for p in dict.fromkeys(firsts)
        ]

    def _on_signal(self, signum, frame) -> None:
        self.signalled_at = time.monotonic()

    def check(self) -> None:
        """Raise ``PeerLost`` if signalled and the recovery is announced; forget a stray signal."""
        if self.signalled_at is None:
            return
        if self.announced():
            self.signalled_at, self.fired = None, True
            raise PeerLost("a peer was lost: this step cannot complete (interrupted by the node agent)")
        if time.monotonic() - self.signalled_at > self.patience_s:
            self.signalled_at = None

    def _check_forward(self, module, args) -> None:
        self.check()

    def _check_grad(self, grad) -> None:
        self.check()

    def clear(self) -> bool:
        """After rejoining: forget what came before; whether the loss was noticed by the signal."""
        fired, self.signalled_at, self.fired = self.fired, None, False
        return fired
