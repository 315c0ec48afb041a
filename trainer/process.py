"""Process helpers shared by the launcher and the workers."""

from __future__ import annotations

import os
import signal
import threading


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True


def exit_when_orphaned(on_orphan=None, interval: float = 0.5) -> threading.Thread:
    """Start a daemon thread that ends this process once its parent is gone.

    A launcher whose orchestrator died, or a worker whose agent died, must not keep training
    and writing checkpoints beside the process that resumes the campaign. ``on_orphan`` runs
    first (e.g. to stop children); then the process exits with SIGTERM's status.
    """
    parent = os.getppid()
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(interval):
            if os.getppid() != parent:
                if on_orphan is not None:
                    on_orphan()
                os._exit(128 + signal.SIGTERM)

    t = threading.Thread(target=watch, name="orphan-watchdog", daemon=True)
    t.start()
    return t
