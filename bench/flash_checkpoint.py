"""Flash checkpoint vs direct save, side by side on the same state (default ≈ 1 GiB).

    python bench/flash_checkpoint.py [--layers 4 --d-model 1024 --vocab 32000 --repeats 3]

Prints, for one rank's model + AdamW state:
- blocking time of a checkpoint: direct (torch.save + fsync + rename, what training waits for
  without snapshots) vs flash (copy into pre-touched shared memory), and the ratio;
- torch DCP ``async_save`` of the same model + optimizer state in the same run (what a
  torchtitan user would pick instead): its blocking time (staging to CPU memory, until
  ``async_save`` returns) and its time to durable (until the future resolves: files written and
  fsynced by ``FileSystemWriter``), beside flash's blocking + background persist;
- the first copy into never-touched shared memory (why slots are touched at start-up);
- restore: torch.load(weights_only) + load_state_dict vs from shared memory;
- the saver's background persist of the snapshot (what flash moves off the training path).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, run alone or by python -m bench
from bench.results import Check, report  # noqa: E402
from pretrain.run.jobs import job_config
from pretrain.spec.campaign import parse_spec
from trainer.checkpoint import state
from trainer.checkpoint.flash import SnapshotStore
from trainer.checkpoint.saver import Saver
from trainer.checkpoint.store import stage_store
from trainer.dist import DistInfo
from trainer.evaluate import iter_tensors
from trainer.loop import build_model, snapshot_capacity

BENCH = {
    "title": "Flash checkpoints vs direct saves and torch DCP async_save",
    "order": 10,
    "quick": ["--layers", "1", "--d-model", "128", "--vocab", "2048", "--repeats", "1"],
    "full": [],
    "timeout_s": 1800,
}
CPU0 = DistInfo(0, 0, 1, 0, torch.device("cpu"), "gloo")


def timed(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def dur(seconds: float) -> str:
    """Seconds as ``  2.709 s``, or in milliseconds below 0.1 s (a small state's snapshot)."""
    return f"{seconds:7.3f} s" if seconds >= 0.1 else f"{seconds * 1e3:6.2f} ms"


def dcp_async(model, opt, where: Path, repeats: int) -> tuple[float, float]:
    """Median seconds until ``async_save`` returns (training blocked) and until its future
    resolves (durable), for the model + optimizer state dicts, one process (no_dist)."""
    import torch.distributed.checkpoint as dcp

    blocked, durable = [], []
    for r in range(repeats):
        target = where / f"step_{r}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
            t0 = time.perf_counter()
            future = dcp.async_save(
                {"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=str(target), no_dist=True
            )
            blocked.append(time.perf_counter() - t0)
            future.result()
            durable.append(time.perf_counter() - t0)
        shutil.rmtree(target, ignore_errors=True)
    return statistics.median(blocked), statistics.median(durable)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--disk-dir", default=None, help="where direct saves go (default: a temp dir on the work disk)")
    return p.parse_args()


def bench_config(a: argparse.Namespace, work: Path):
    """The job config of one rank of a one-stage campaign of the model asked for, in ``work``."""
    spec = parse_spec(
        {
            "name": "bench",
            "workdir": str(work),
            "seed": 0,
            "cluster": {"workers_per_node": 1},
            "model": {
                "n_layer": a.layers,
                "n_head": max(1, a.d_model // 64),
                "d_model": a.d_model,
                "max_seq_len": 256,
            },
            "stages": [
                {
                    "name": "bench",
                    "steps": 10,
                    "lr": 1e-3,
                    "min_lr": 1e-4,
                    "warmup_steps": 1,
                    "micro_batch": 1,
                    "seq_len": 8,
                }
            ],
        }
    )
    return job_config(spec, 0, 0, None, a.vocab).amended(
        data={"uri": ""}, checkpoint={"location": str(work / "ckpt")}, job_dir=str(work)
    )


def trained_state(cfg, vocab: int):
    """The model and AdamW after one step (the optimizer state exists), their training state and its bytes."""
    model, opt = build_model(cfg, torch.device("cpu"))
    model(torch.randint(0, vocab, (1, 8))).float().mean().backward()
    opt.step()
    st = state.training_state(cfg, CPU0, step=1, consumed=1, model=model, optimizer=opt)
    nbytes = sum(t.numel() * t.element_size() for t in iter_tensors(st))
    print(
        f"state: {nbytes / 2**30:.2f} GiB ({model.num_params() / 1e6:.0f}M params + AdamW), torch "
        f"{torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    return model, opt, st, nbytes


def memcpy_floor(nbytes: int, repeats: int) -> float:
    """The floor: one copy of the same bytes, pre-touched (the 2 GiB are freed on return)."""
    src, dst = torch.empty(nbytes, dtype=torch.uint8).fill_(1), torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    return timed(lambda: dst.copy_(src), repeats)


def flash_snapshots(cfg, st, shm: Path, repeats: int) -> tuple[SnapshotStore, dict[str, float]]:
    """The store of the steady snapshots, the first copy's seconds into untouched shared memory
    and a steady snapshot's blocking seconds (median)."""
    cold = SnapshotStore(shm / "cold", 0, 0, 1, capacity=0)  # no pre-allocation: pays page faults
    t0 = time.perf_counter()
    cold.snapshot(1, st, persist=False)
    first_cold = time.perf_counter() - t0
    cold.flush()
    store = SnapshotStore(shm / "warm", 0, 0, 1, capacity=snapshot_capacity(cfg, 0))  # allocated + touched
    blocked = []
    for step in range(2, 2 + repeats):
        blocked.append(store.snapshot(step, st, persist=False))  # returns the blocking seconds
        store.flush()  # let the digest finish, as the interval between snapshots would
    return store, {"first_cold": first_cold, "flash": statistics.median(blocked)}


def restore_times(cfg, store: SnapshotStore, repeats: int) -> tuple[int, dict[str, float]]:
    """The newest snapshot's step, and the seconds of a restore from disk, of its digest check and
    of a restore from shared memory (digest check included)."""
    ref = stage_store(cfg).latest_complete()
    fresh, fresh_opt = build_model(cfg, torch.device("cpu"))

    def from_disk():
        s = stage_store(cfg).load_shard(ref.step, state.MODEL_SHARD)
        fresh.load_state_dict(s["model"])
        fresh_opt.load_state_dict(s["optimizer"])

    newest = max(store.sealed_steps())

    def from_memory():
        assert store.verify(newest)
        snap = store.load(newest)
        fresh.load_state_dict(snap["shared"]["model"])
        fresh_opt.load_state_dict(snap["shared"]["optimizer"])

    disk_restore = timed(from_disk, repeats)
    verify = timed(lambda: store.verify(newest), repeats)
    mem_restore = timed(from_memory, repeats)
    return newest, {"disk_restore": disk_restore, "verify": verify, "mem_restore": mem_restore}


def print_table(t: dict[str, float]) -> None:
    direct, flash, memcpy, first_cold = t["direct"], t["flash"], t["memcpy"], t["first_cold"]
    dcp_blocked, disk_restore, mem_restore = t["dcp_blocked"], t["disk_restore"], t["mem_restore"]
    print(f"{'blocking save: direct (torch.save+fsync)':46s} {dur(direct)}")
    print(f"{'blocking save: flash (copy to shared memory)':46s} {dur(flash)}   → {direct / flash:5.1f}× less blocking")
    print(f"{'  raw memcpy of the same bytes (the floor)':46s} {dur(memcpy)}   (flash = {flash / memcpy:4.2f}× memcpy)")
    print(
        f"{'  first copy into untouched shared memory':46s} {dur(first_cold)}   ({first_cold / flash:4.1f}× a "
        f"steady copy)"
    )
    print(
        f"{'blocking save: torch DCP async_save (staging)':46s} {dur(dcp_blocked)}   "
        f"(flash = {flash / dcp_blocked:4.2f}× DCP async)"
    )
    print(f"{'to durable: direct':46s} {dur(direct)}")
    print(f"{'to durable: DCP async_save (future resolved)':46s} {dur(t['dcp_durable'])}")
    print(f"{'to durable: flash (blocking + saver persist)':46s} {dur(flash + t['persist'])}")
    print(f"{'restore: torch.load + load_state_dict':46s} {dur(disk_restore)}")
    print(
        f"{'restore: shared memory (incl. digest check)':46s} {dur(mem_restore)}   "
        f"→ {disk_restore / mem_restore:5.1f}× faster"
    )
    print(f"{'  of which xxh3 digest check':46s} {dur(t['verify'])}")
    print(f"{'saver persist (background, fsynced)':46s} {dur(t['persist'])}")


def main() -> None:
    a = parse_args()
    work = Path(tempfile.mkdtemp(dir=a.disk_dir or "."))
    shm = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        cfg = bench_config(a, work)
        model, opt, st, nbytes = trained_state(cfg, a.vocab)
        t = {"direct": timed(lambda: state.save(cfg, CPU0, step=1, consumed=1, model=model, optimizer=opt), a.repeats)}
        t["dcp_blocked"], t["dcp_durable"] = dcp_async(model, opt, work / "dcp", a.repeats)
        t["memcpy"] = memcpy_floor(nbytes, a.repeats)
        store, flash = flash_snapshots(cfg, st, shm, a.repeats)
        newest, restore = restore_times(cfg, store, a.repeats)
        t.update(flash, **restore)

        shutil.rmtree(work / "ckpt")
        saver = Saver(shm / "warm", 1, stage_store(cfg), keep=1, events=None)
        t["persist"] = timed(lambda: saver.persist(newest), 1)
        print_table(t)
        report(
            [
                Check(
                    "flash blocking / DCP async_save blocking",
                    round(t["flash"] / t["dcp_blocked"], 3),
                    1.0,
                    "<=",
                    "flash copies the whole state into shared memory, DCP stages into private memory it may reuse",
                )
            ],
            state_gib=round(nbytes / 2**30, 3),
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
