"""The node's checkpoint saver: ``python -m trainer.saver --ns SHM_DIR --nproc N --job JOB.json [--agent PID]``
(the saver itself: ``trainer.checkpoint.saver``).

Started by the node agent (``trainer.agent.node``) before the workers and kept alive across their
restarts; SIGTERM makes it save at breakpoint and exit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.checkpoint.saver import serve
from trainer.common.process import exit_now


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.saver")
    p.add_argument("--ns", type=Path, required=True, help="the node's shared-memory snapshot directory")
    p.add_argument("--nproc", type=int, required=True, help="workers on this node")
    p.add_argument("--job", type=Path, required=True, help="the job config: checkpoint location, retention, job dir")
    p.add_argument(
        "--agent",
        type=int,
        default=None,
        help="the node agent's process id (default: the parent's): "
        "named in the saver's events; the saver saves at breakpoint and ends once it is gone",
    )
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    return serve(args.ns, args.nproc, args.job, args.agent)


if __name__ == "__main__":
    exit_now(main())  # whoever started it waits for the exit: no module teardown
