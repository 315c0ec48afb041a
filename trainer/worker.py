"""Worker entry point: ``python -m trainer.worker JOB.json`` (one process per rank).

Started by the elastic agent (``trainer.launch``); its command line names this module so an
operator can find the workers of a job with ``ps`` and signal them.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import torch

from trainer.config import JobConfig
from trainer.dist import init_distributed, shutdown_and_exit
from trainer.events import error_event
from trainer.loop import train
from trainer.process import exit_when_orphaned
from trainer.reporting import EVENTS, JsonLines
from trainer.resilience.heartbeat import Heartbeat, collective_timeout_s


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m trainer.worker")
    p.add_argument("job", help="job config JSON")
    p.add_argument("--shm", help="the node's shared-memory snapshot directory (flash checkpoints)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    exit_when_orphaned()
    cfg = JobConfig.load(args.job)
    if cfg.threads_per_worker:
        torch.set_num_threads(cfg.threads_per_worker)
    code = 0
    try:
        heartbeat = Heartbeat(cfg.job_dir, int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("RANK", "0")))
        heartbeat.beat("startup", 0)
        info = init_distributed(cfg.backend, timeout_s=collective_timeout_s(cfg.hang_timeouts))
        train(cfg, info, shm_ns=args.shm, heartbeat=heartbeat)
    except BaseException as err:  # noqa: BLE001 - report every failure, then exit non-zero
        traceback.print_exc()
        report = JsonLines(Path(cfg.job_dir) / EVENTS)
        report.write(error_event(err, rank=int(os.environ.get("RANK", "0")), traceback=traceback.format_exc()[-2000:]))
        code = 1
    shutdown_and_exit(code)


if __name__ == "__main__":
    main()
