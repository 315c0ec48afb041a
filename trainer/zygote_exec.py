"""``python -m trainer.zygote_exec --zygote PATH [--unbuffered] [--env NAME=VALUE] MODULE ARGV...``: run
``python -m MODULE ARGV`` forked from a zygote, for a launcher that can only start a command line (torch's elastic
agent).

It stands in for the process it asks for: the child gets this process's environment, working
directory and standard streams; SIGTERM, SIGINT and SIGHUP sent to this process are passed on to
it; this process ends as the child ended (its exit code, or killed by the same signal). It
imports no torch, so a worker of a job of several nodes starts in a fraction of a second instead
of importing torch afresh (~2 CPU-s), at the job's start and after every restart. If it dies,
the zygote stops the child (its client's connection closed); if its parent dies, it stops the
child and ends (the orphan watchdog). No usable zygote: the child is a fresh interpreter.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from trainer.common.process import exit_now, exit_when_orphaned
from trainer.zygote.client import Zygote

PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.zygote_exec")
    p.add_argument("--zygote", required=True, help="the zygote's socket path")
    p.add_argument("--unbuffered", action="store_true", help="the child's stdout and stderr unbuffered (python -u)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="set in the child's environment")
    p.add_argument("module", help="the module to run as __main__")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    zygote = Zygote.connect(args.zygote, log=lambda line: print(line, file=sys.stderr, flush=True))
    env = {**os.environ, **dict(item.split("=", 1) for item in args.env)}
    if args.unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    # A signal that comes while the child is being forked is passed on once it exists: its default
    # action would have ended this process and so stopped the child unwarned.
    started: list = []
    early: list[int] = []

    def pass_on(signum, frame):
        started[0].send_signal(signum) if started else early.append(signum)

    for sig in PASSED_ON:
        signal.signal(sig, pass_on)
    child = zygote.spawn(args.module, args.args, env=env)
    started.append(child)
    for signum in early:
        child.send_signal(signum)
    exit_when_orphaned(on_orphan=child.kill)
    code = child.wait()
    if code < 0:  # end as the child did: killed by that signal
        if -code in PASSED_ON:
            signal.signal(-code, signal.SIG_DFL)
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    exit_now(main())
