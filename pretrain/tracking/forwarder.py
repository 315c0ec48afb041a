"""The metrics forwarder in a thread of its own: the loop that watches a job never waits on MLflow.

MLflow's client retries a request to a server that stopped answering for minutes (7 retries,
a 120 s timeout each) before it raises. Called from the job's loop, one such request held
everything the loop does — a stop or pause request within its grace period, a lost node, the
validation gate. Here the forwarder pumps in its own thread (in a copy of the caller's context,
so a block's MLflow token goes with it); at the job's end the caller waits for its drain at most
``drain_s`` (plus a margin), and what is still unsent stays in the job's files for a later sync
(``tasks.mlflow_sync``).
"""

from __future__ import annotations

import contextvars
import threading

from pretrain.tracking.metrics import MetricsForwarder

JOIN_MARGIN_S = 10.0  # beyond the drain's own timeout: one request in flight may end meanwhile


class ForwarderThread:
    def __init__(self, forwarder: MetricsForwarder, poll_s: float, drain_s: float, margin_s: float = JOIN_MARGIN_S):
        self.forwarder, self.poll_s, self.drain_s, self.margin_s = forwarder, poll_s, drain_s, margin_s
        self.drained = False  # everything read reached MLflow at the end
        self._stop = threading.Event()
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._run,), name="mlflow-forwarder", daemon=True)

    def start(self) -> ForwarderThread:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.poll_s):
                self.forwarder.pump()
            self.drained = self.forwarder.drain(self.drain_s)
        except Exception as err:  # noqa: BLE001 - the job's files keep every step; a later sync sends them
            self.forwarder.log(
                f"the MLflow forwarder stopped ({type(err).__name__}: {err}); the steps stay in "
                f"{self.forwarder.path} for a later sync"
            )

    def stop(self) -> None:
        """Let the thread drain and end on its own; nobody waits for it."""
        self._stop.set()

    def finish(self) -> bool:
        """After the job: the forwarder drains (up to ``drain_s``, unless MLflow's server does not
        answer at all); whether everything reached MLflow. A request still hanging on MLflow
        then is left to itself (the thread is a daemon): the caller goes on, and the steps stay
        in the job's files."""
        self._stop.set()
        self._thread.join(min(self.poll_s, self.drain_s))
        if self._thread.is_alive() and not (away := self.forwarder.tracker.away()):  # it answers: worth the wait
            self._thread.join(self.drain_s + self.margin_s)
            away = f"a request unanswered for over {self.drain_s + self.margin_s:.0f}s"
        if self._thread.is_alive():
            self.forwarder.log(
                f"MLflow tracking: MLflow is away ({away}); the job's steps stay in "
                f"{self.forwarder.path} for a later sync"
            )
            return False
        return self.drained
