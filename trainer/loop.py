"""The training loop of one stage, run by every worker of the job."""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer import state
from trainer.config import JobConfig
from trainer.data import GlobalSampler, TokenWindows, make_batch, micro_batch_positions
from trainer.dist import DistInfo, all_reduce_mean
from trainer.model import GPT, lm_loss, lr_at, param_groups
from trainer.reporting import EVENTS, METRICS, JsonLines


class NonFiniteLoss(RuntimeError):
    """The loss became NaN/Inf; the job stops so the orchestrator can resume from a checkpoint."""


def seed_everything(seed: int, device: torch.device) -> None:
    torch.manual_seed(seed)
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True)


def build_model(cfg: JobConfig, device: torch.device) -> tuple[GPT, torch.optim.Optimizer]:
    model = GPT(cfg.model).to(device)
    opt = torch.optim.AdamW(param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr,
                            betas=(0.9, 0.95), eps=1e-8)
    return model, opt


def train(cfg: JobConfig, info: DistInfo) -> int:
    """Train until the stage's last step; returns the final step."""
    o = cfg.optim
    seed_everything(cfg.seed, info.device)
    job_dir = Path(cfg.job_dir)
    events = JsonLines(job_dir / EVENTS)
    metrics = JsonLines(job_dir / METRICS) if info.rank == 0 else None

    model, opt = build_model(cfg, info.device)
    restored = state.restore(cfg, info, model=model, optimizer=opt)
    step, consumed = restored.step, restored.consumed
    events.write({"event": "start", "rank": info.rank, "world_size": info.world_size,
                  "restart_count": info.restart_count, "step": step, "source": restored.source,
                  "checkpoint": restored.checkpoint})

    net = DDP(model) if info.world_size > 1 else model
    windows = TokenWindows(cfg.data_dir, "train", o.seq_len)
    sampler = GlobalSampler(len(windows), cfg.seed, stream=cfg.stage_index)
    global_batch = info.world_size * o.micro_batch * o.grad_accum
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if info.device.type == "cuda" else nullcontext())

    while step < o.steps:
        t0 = time.perf_counter()
        lr = lr_at(step, lr=o.lr, min_lr=o.min_lr, warmup=o.warmup_steps, total=o.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=info.device)
        for m in range(o.grad_accum):
            positions = micro_batch_positions(consumed, world=info.world_size, rank=info.rank,
                                              micro=o.micro_batch, accum_index=m)
            x, y = (t.to(info.device, non_blocking=True) for t in make_batch(windows, sampler, positions))
            sync = nullcontext() if (m == o.grad_accum - 1 or net is model) else net.no_sync()
            with sync:
                with autocast:
                    loss = lm_loss(net(x), y) / o.grad_accum
                loss.backward()
            loss_sum += loss.detach().float()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        consumed += global_batch
        mean_loss = all_reduce_mean(loss_sum).item()
        if not math.isfinite(mean_loss):
            events.write({"event": "nonfinite_loss", "step": step, "loss": repr(mean_loss)})
            raise NonFiniteLoss(f"loss is {mean_loss} at step {step}")
        dt = time.perf_counter() - t0
        if metrics is not None and (step % cfg.log_every == 0 or step == o.steps):
            metrics.write({"step": step, "loss": mean_loss, "lr": lr, "grad_norm": float(grad_norm),
                           "step_time": dt, "tokens_per_s": global_batch * o.seq_len / dt,
                           "consumed": consumed})
        if step % cfg.ckpt_interval == 0 or step == o.steps:
            ref = state.save(cfg, info, step=step, consumed=consumed, model=model, optimizer=opt)
            if info.rank == 0:
                events.write({"event": "checkpoint", "step": step, "path": str(ref.path)})
    events.write({"event": "done", "rank": info.rank, "step": step})
    events.close()
    if metrics is not None:
        metrics.close()
    return step
