"""The node check, one process per worker slot:
``python -m trainer.nodecheck --rank R --world W --master-port P --workdir DIR`` (the measurements
and their judgement: ``trainer.resilience.nodecheck``). Prints one JSON line, and writes it to
``--out`` when given (a pod of a Kubernetes node check: the orchestrator reads it from the shared
workdir; ``--master-addr`` is then the DNS name of the check's pod 0).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch

from trainer.common.atomic import atomic_write_json
from trainer.common.process import exit_now, exit_when_orphaned
from trainer.resilience.nodecheck import allreduce_mbps, matmul_seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.nodecheck")
    p.add_argument("--workdir", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--master-port", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1", help="host of rank 0 (its TCPStore)")
    p.add_argument("--out", help="also write the JSON row to this file (atomically)")
    p.add_argument("--extra-delay", type=float, default=0.0, help="seconds added per matmul (chaos drill)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    exit_when_orphaned()  # started by `pretrain run`: never outlive it
    torch.set_num_threads(1)
    row = {
        "rank": args.rank,
        "torch": torch.__version__,
        "cuda_devices": torch.cuda.device_count(),
        "matmul_s": round(matmul_seconds(extra_delay_s=args.extra_delay), 4),
        "shm_free_bytes": shutil.disk_usage("/dev/shm").free,
        "disk_free_bytes": shutil.disk_usage(args.workdir).free,
    }
    if args.world > 1:
        row["allreduce_MBps"] = round(allreduce_mbps(args.rank, args.world, args.master_port, host=args.master_addr), 1)
    if args.out:
        atomic_write_json(args.out, row)
    print(json.dumps(row), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip gloo's teardown at interpreter exit (see docs/platform.md)


if __name__ == "__main__":
    exit_now(main())  # whoever started it waits for the exit: no module teardown
