"""GPU: training throughput and MFU of a ~350M-parameter GPT, flash checkpoints of GPU tensors.

    python bench/gpu.py [--steps 20 --warmup 5 --micro-batch 8 --seq-len 1024 --compile]
    torchrun --nproc-per-node 8 bench/gpu.py      # every GPU of the node (rank 0 reports)
    python bench/gpu.py --smoke                    # the same code on CPU, tiny: proves it runs

Needs a CUDA device; without one it reports "skipped: no CUDA device" (``--smoke`` runs the
same code paths on CPU at a toy size, gloo instead of NCCL, for machines without a GPU).

1. Training: the trainer's model (``trainer.model.GPT``, GPT-2 medium shape: 24 layers,
   d_model 1024, 16 heads, vocab 50304 ≈ 354M parameters) under DDP with NCCL, bf16 autocast,
   scaled-dot-product attention pinned to the flash kernel, fused AdamW, optionally
   ``torch.compile``; random tokens already on the device (compute, not data loading). Tokens/s
   per GPU after ``--warmup`` steps, and MFU = (6·N + 12·L·d·T) · tokens/s / peak bf16 FLOP/s
   (N: parameters without the position table; peak from the device name, or ``--peak-tflops``).
2. Flash checkpoint of the same model + AdamW state on the GPU into shared memory: what the
   trainer does today (``SnapshotStore.snapshot`` copies device tensors straight into the
   shared-memory slot: device → pageable host), and staged through pre-allocated pinned host
   buffers (device → pinned host is all training waits for; pinned → shared memory can run on
   a background thread), each step's blocking time as the median of ``--repeats``.
3. Restore from shared memory onto the GPU: digest check, copy out, ``load_state_dict``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, run alone or by python -m bench

import torch  # noqa: E402

from bench.results import Check, report  # noqa: E402

BENCH = {
    "title": "GPU: tokens/s and MFU of a 350M GPT, flash checkpoints of GPU tensors",
    "order": 70,
    "quick": ["--steps", "6", "--warmup", "2", "--repeats", "1"],
    "full": ["--compile"],
    "timeout_s": 3600,
}
# dense bf16 peak, TFLOP/s, by a substring of torch.cuda.get_device_name (first match wins)
PEAK_BF16_TFLOPS = [
    ("H100 PCIe", 756.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 125.0),
    ("A10", 125.0),
]
MFU_TARGET = 0.35  # a well-tuned single-node GPT-2-medium run with flash attention reaches ~40 %


def peak_tflops(device_name: str) -> float | None:
    return next((tf for key, tf in PEAK_BF16_TFLOPS if key in device_name), None)


def flops_per_token(n_params_no_pos: int, n_layer: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token (PaLM appendix B): 6 per weight plus attention's 12·L·d·T."""
    return 6 * n_params_no_pos + 12 * n_layer * d_model * seq_len


def init_dist(device: torch.device) -> tuple[int, int, int]:
    """(rank, local_rank, world): from torchrun's environment, or a world of one."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        torch.cuda.set_device(local)
    if "RANK" in os.environ:  # torchrun's environment
        dist.init_process_group(backend)
    else:  # a world of one, its rendezvous given directly (this process's environment stays as it is)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return dist.get_rank(), local, dist.get_world_size()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_throughput(a, device: torch.device, local: int):
    """Tokens/s of this rank; returns (tokens_per_s, model, optimizer, raw model)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainer.job.config import ModelConfig
    from trainer.model import GPT, lm_loss, param_groups

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=a.vocab, n_layer=a.layers, n_head=a.heads, d_model=a.d_model, max_seq_len=a.seq_len, dropout=0.0
    )
    raw = GPT(cfg).to(device)
    model = torch.compile(raw) if a.compile else raw
    net = DDP(model, device_ids=[local]) if device.type == "cuda" else DDP(model)
    opt = torch.optim.AdamW(param_groups(raw, 0.1), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    x = torch.randint(0, a.vocab, (a.micro_batch, a.seq_len + 1), device=device)
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        attention = sdpa_kernel(SDPBackend.FLASH_ATTENTION)  # fails loudly if flash cannot run
    else:
        attention = nullcontext()
    t0 = 0.0
    with attention:
        for step in range(a.warmup + a.steps):
            if step == a.warmup:
                sync(device)
                t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = lm_loss(net(x[:, :-1]), x[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    sync(device)
    seconds = time.perf_counter() - t0
    return a.steps * a.micro_batch * a.seq_len / seconds, raw, opt, loss.item()


def to_host_like(obj, pinned: bool):
    """The same structure with every tensor replaced by an empty host tensor (pinned if asked)."""
    if isinstance(obj, torch.Tensor):
        return torch.empty(obj.shape, dtype=obj.dtype, pin_memory=pinned)
    if isinstance(obj, dict):
        return {k: to_host_like(v, pinned) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host_like(v, pinned) for v in obj)
    return obj


def copy_into(dst, src) -> None:
    if isinstance(src, torch.Tensor):
        dst.copy_(src, non_blocking=True)
    elif isinstance(src, dict):
        for k in src:
            copy_into(dst[k], src[k])
    elif isinstance(src, (list, tuple)):
        for d, s in zip(dst, src):
            copy_into(d, s)


def checkpoint_times(a, device: torch.device, model, opt) -> dict[str, float | str]:
    """Blocking seconds of a flash snapshot of GPU state: direct and staged through pinned
    memory; restore seconds from shared memory onto the device."""
    from trainer.checkpoint.flash import SnapshotStore
    from trainer.checkpoint.shm import ShmTooSmall
    from trainer.evaluate import iter_tensors

    st = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    nbytes = sum(t.numel() * t.element_size() for t in iter_tensors(st))
    ns = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="bench-gpu-"))
    out: dict[str, float | str] = {"state_gib": nbytes / 2**30}
    try:
        try:
            store = SnapshotStore(ns, 0, 0, 1, capacity=nbytes + (1 << 20))
        except ShmTooSmall as err:
            out["skipped"] = f"shared memory too small for 2 slots of {nbytes / 2**30:.1f} GiB: {err}"
            return out
        direct, staged, background = [], [], []
        use_pinned = device.type == "cuda"
        host = to_host_like(st, pinned=use_pinned)
        for r in range(a.repeats):
            sync(device)
            blocked = store.snapshot(2 * r + 1, st, persist=False, wait=True)  # device → shared memory
            direct.append(blocked)
            store.flush()
            sync(device)
            t0 = time.perf_counter()
            copy_into(host, st)  # device → pinned host: what training waits for
            sync(device)
            staged.append(time.perf_counter() - t0)
            background.append(store.snapshot(2 * r + 2, host, persist=False, wait=True))  # pinned → shm
            store.flush()
        newest = max(store.sealed_steps())
        sync(device)
        t0 = time.perf_counter()
        assert store.verify(newest), "the snapshot just written does not match its digest"
        snap = store.load(newest)
        model.load_state_dict(snap["model"])
        opt.load_state_dict(snap["optimizer"])
        sync(device)
        out.update(
            direct_s=statistics.median(direct),
            staged_s=statistics.median(staged),
            staged_background_s=statistics.median(background),
            restore_s=time.perf_counter() - t0,
            pinned="pinned" if use_pinned else "pageable (no CUDA: smoke run)",
        )
        return out
    finally:
        shutil.rmtree(ns, ignore_errors=True)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak (default: by name)")
    ap.add_argument("--smoke", action="store_true", help="no CUDA: run the same code on CPU at a toy size")
    return ap.parse_args()


def measure(a, device: torch.device, local: int):
    """Training throughput (eager again if ``torch.compile`` fails), then the checkpoint times of
    the trained state; the process group is destroyed after. Returns (tokens/s, raw model, last
    loss, checkpoint times, why compile failed or None)."""
    import torch.distributed as dist

    compile_failed = None
    try:
        try:
            rate, model, opt, loss = train_throughput(a, device, local)
        except Exception as err:  # noqa: BLE001 - torch.compile's failures are many (no compiler, triton …)
            if not a.compile:
                raise
            compile_failed, a.compile = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}", False
            rate, model, opt, loss = train_throughput(a, device, local)
        ckpt = checkpoint_times(a, device, model, opt)
    finally:
        dist.destroy_process_group()
    return rate, model, loss, ckpt, compile_failed


def print_setup(a, device: torch.device, world: int, name: str, model, compile_failed: str | None) -> None:
    nccl = torch.cuda.nccl.version() if device.type == "cuda" else "n/a (gloo)"
    print(
        f"{name}, {world} rank(s), torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"NCCL {'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}"
    )
    print(
        f"GPT {model.num_params() / 1e6:.0f}M params ({a.layers} layers, d_model {a.d_model}, vocab {a.vocab}); "
        f"micro-batch {a.micro_batch} × {a.seq_len}; bf16 autocast, "
        f"{'flash SDPA' if device.type == 'cuda' else 'default SDPA'}, {'torch.compile' if a.compile else 'eager'}"
    )
    if compile_failed:
        print(f"torch.compile failed ({compile_failed}): measured eager")


def print_results(a, rate: float, loss: float, mfu: float | None, peak: float | None, ckpt: dict) -> None:
    print(
        f"{'training, per GPU':44s} {rate:>12,.0f} tokens/s   ({a.steps} steps after {a.warmup} warm-up; loss "
        f"{loss:.2f})"
    )
    print(
        f"{'MFU':44s} {f'{mfu * 100:11.1f} %' if mfu is not None else '     unknown'}   "
        f"(peak {peak or '?'} TFLOP/s bf16)"
    )
    if "skipped" in ckpt:
        print(f"flash checkpoint: skipped: {ckpt['skipped']}")
        return
    print(f"{'state (model + AdamW) on the device':44s} {ckpt['state_gib']:11.2f} GiB")
    print(f"{'flash blocking: device → shared memory':44s} {ckpt['direct_s']:11.3f} s   (what the trainer does today)")
    print(
        f"{'flash blocking: device → ' + ckpt['pinned'][:8] + ' host':44s} {ckpt['staged_s']:11.3f} s   "
        f"→ {ckpt['direct_s'] / ckpt['staged_s']:.1f}× less blocking"
    )
    print(f"{'  then host → shared memory (background)':44s} {ckpt['staged_background_s']:11.3f} s")
    print(f"{'restore: shared memory → device (with digest)':44s} {ckpt['restore_s']:11.3f} s")


def report_checks(a, on_cuda: bool, mfu: float | None, **facts) -> None:
    """The MFU check (when the peak is known) to the runner; ``facts``: what to keep besides."""
    checks = []
    if mfu is not None:
        checks.append(
            Check(
                "MFU, bf16, per GPU",
                round(mfu, 3),
                MFU_TARGET,
                ">=",
                "no torch.compile (eager kernels)"
                if not a.compile
                else "micro-batch or sequence too small to fill the device, or DDP's all-reduce not overlapped",
            )
        )
    report(checks, skipped=None if on_cuda else "no CUDA device (smoke run on CPU)", **facts)


def main() -> None:
    a = parse_args()
    if not torch.cuda.is_available():
        if not a.smoke:
            print("skipped: no CUDA device")
            report(skipped="no CUDA device")
            return
        a.layers, a.d_model, a.heads, a.vocab, a.seq_len, a.micro_batch = 2, 64, 2, 512, 64, 2
        a.steps, a.warmup, a.repeats, a.compile = min(a.steps, 3), 1, 1, False
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rank, local, world = init_dist(device)
    rate, model, loss, ckpt, compile_failed = measure(a, device, local)
    if rank != 0:
        return
    name = torch.cuda.get_device_name(local) if device.type == "cuda" else "CPU (smoke run)"
    n = model.num_params() - model.wpe.weight.numel()
    peak = a.peak_tflops or (peak_tflops(name) if device.type == "cuda" else None)
    mfu = rate * flops_per_token(n, a.layers, a.d_model, a.seq_len) / (peak * 1e12) if peak else None
    print_setup(a, device, world, name, model, compile_failed)
    print_results(a, rate, loss, mfu, peak, ckpt)
    report_checks(a, device.type == "cuda", mfu, tokens_per_s=round(rate), world=world, device=name)


if __name__ == "__main__":
    main()
