"""Flash checkpoint vs direct save, side by side on the same state (default ≈ 1 GiB).

    python bench/flash_checkpoint.py [--layers 4 --d-model 1024 --vocab 32000 --repeats 3]

Prints, for one rank's model + AdamW state:
- blocking time of a checkpoint: direct (torch.save + fsync + rename, what training waits for
  without snapshots) vs flash (copy into pre-touched shared memory), and the ratio;
- the first copy into never-touched shared memory (why slots are touched at start-up);
- restore: torch.load(weights_only) + load_state_dict vs from shared memory;
- the saver's background persist of the snapshot (what flash moves off the training path).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pretrain.jobs import job_config
from pretrain.spec import parse_spec
from trainer.checkpoint import state
from trainer.checkpoint.flash import SnapshotStore
from trainer.checkpoint.saver import Saver
from trainer.dist import DistInfo
from trainer.evaluate import iter_tensors
from trainer.loop import build_model, snapshot_capacity

CPU0 = DistInfo(0, 0, 1, 0, torch.device("cpu"), "gloo")


def timed(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--disk-dir", default=None, help="where direct saves go (default: a temp dir on the work disk)")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(dir=a.disk_dir or "."))
    shm = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        spec = parse_spec({"name": "bench", "workdir": str(work), "seed": 0, "cluster": {"workers_per_node": 1},
                           "model": {"n_layer": a.layers, "n_head": max(1, a.d_model // 64), "d_model": a.d_model,
                                     "max_seq_len": 256},
                           "stages": [{"name": "bench", "steps": 10, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 1,
                                       "micro_batch": 1, "seq_len": 8}]})
        cfg = dataclasses.replace(job_config(spec, 0, 0, None, a.vocab), data_dir="", ckpt_dir=str(work / "ckpt"),
                                  job_dir=str(work))
        model, opt = build_model(cfg, torch.device("cpu"))
        model(torch.randint(0, a.vocab, (1, 8))).float().mean().backward()
        opt.step()
        st = state.training_state(cfg, CPU0, step=1, consumed=1, model=model, optimizer=opt)
        nbytes = sum(t.numel() * t.element_size() for t in iter_tensors(st))
        print(f"state: {nbytes / 2**30:.2f} GiB ({model.num_params() / 1e6:.0f}M params + AdamW), torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads")

        direct = timed(lambda: state.save(cfg, CPU0, step=1, consumed=1, model=model, optimizer=opt), a.repeats)
        src, dst = torch.empty(nbytes, dtype=torch.uint8).fill_(1), torch.empty(nbytes, dtype=torch.uint8).fill_(0)
        memcpy = timed(lambda: dst.copy_(src), a.repeats)  # the floor: one copy of the same bytes, pre-touched
        src = dst = None  # free 2 GiB before the rest

        cold = SnapshotStore(shm / "cold", 0, 0, 1, capacity=0)  # no pre-allocation: pays page faults
        t0 = time.perf_counter()
        cold.snapshot(1, st, persist=False)
        first_cold = time.perf_counter() - t0
        cold.flush()
        store = SnapshotStore(shm / "warm", 0, 0, 1, capacity=snapshot_capacity(cfg, 0))  # allocated + touched
        blocked = []
        for step in range(2, 2 + a.repeats):
            blocked.append(store.snapshot(step, st, persist=False))  # returns the blocking seconds
            store.flush()  # let the digest finish, as the interval between snapshots would
        flash = statistics.median(blocked)

        ref = cfg.checkpoints().latest_complete()
        fresh, fresh_opt = build_model(cfg, torch.device("cpu"))

        def from_disk():
            s = cfg.checkpoints().load_shard(ref.step, state.MODEL_SHARD)
            fresh.load_state_dict(s["model"])
            fresh_opt.load_state_dict(s["optimizer"])

        newest = max(store.sealed_steps())

        def from_memory():
            assert store.verify(newest)
            snap = store.load(newest)
            fresh.load_state_dict(snap["shared"]["model"])
            fresh_opt.load_state_dict(snap["shared"]["optimizer"])

        disk_restore = timed(from_disk, a.repeats)
        verify = timed(lambda: store.verify(newest), a.repeats)
        mem_restore = timed(from_memory, a.repeats)

        shutil.rmtree(work / "ckpt")
        saver = Saver(shm / "warm", 1, cfg.checkpoints(), keep=1, events=None)
        persist = timed(lambda: saver.persist(newest), 1)

        print(f"{'blocking save: direct (torch.save+fsync)':46s} {direct:7.3f} s")
        print(f"{'blocking save: flash (copy to shared memory)':46s} {flash:7.3f} s   → {direct / flash:5.1f}× less blocking")
        print(f"{'  raw memcpy of the same bytes (the floor)':46s} {memcpy:7.3f} s   (flash = {flash / memcpy:4.2f}× memcpy)")
        print(f"{'  first copy into untouched shared memory':46s} {first_cold:7.3f} s   ({first_cold / flash:4.1f}× a steady copy)")
        print(f"{'restore: torch.load + load_state_dict':46s} {disk_restore:7.3f} s")
        print(f"{'restore: shared memory (incl. digest check)':46s} {mem_restore:7.3f} s   → {disk_restore / mem_restore:5.1f}× faster")
        print(f"{'  of which xxh3 digest check':46s} {verify:7.3f} s")
        print(f"{'saver persist (background, fsynced)':46s} {persist:7.3f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
