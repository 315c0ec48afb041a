"""Node health check: ``python -m trainer.healthcheck --workdir DIR`` prints one JSON line.

Measures what a training node needs before workers start: torch works, a short matmul
benchmark (GFLOP/s), free shared memory and free disk under the workdir.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time

import torch


def matmul_gflops(n: int = 256, reps: int = 20) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9


def check(workdir: str) -> dict:
    return {
        "torch": torch.__version__,
        "cuda_devices": torch.cuda.device_count(),
        "matmul_gflops": round(matmul_gflops(), 2),
        "shm_free_bytes": shutil.disk_usage("/dev/shm").free,
        "disk_free_bytes": shutil.disk_usage(workdir).free,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.healthcheck")
    p.add_argument("--workdir", required=True)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    print(json.dumps(check(args.workdir)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
