"""The training loop of one stage, run by every worker of the job."""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.checkpoint import state
from trainer.checkpoint.flash import SnapshotStore
from trainer.checkpoint.shm import ShmTooSmall
from trainer.data.sampler import TokenWindows, make_batch, make_sampler, micro_batch_positions
from trainer.dist import DistInfo, all_reduce_mean, is_initialized, local_world_size
from trainer.job.config import JobConfig
from trainer.job.events import EventKind
from trainer.job.reporting import EVENTS, METRICS, JsonLines
from trainer.model import GPT, lm_loss, lr_at, param_groups
from trainer.resilience.anomaly import LossAnomaly, SpikeDetector, record_skip, skip_past
from trainer.resilience.chaos import WorkerChaos
from trainer.resilience.heartbeat import Heartbeat
from trainer.resilience.nodecheck import check_after_restart, this_node
from trainer.resilience.peers import Peers, rejoin
from trainer.resilience.rollback import roll_back, skip_windows
from trainer.resilience.survivor_interrupt import Interrupt


def checkpoint(
    cfg: JobConfig,
    info: DistInfo,
    snapshots,
    events: JsonLines,
    *,
    step: int,
    consumed: int,
    model,
    optimizer,
    loss: float | None = None,
) -> float | None:
    """Take the checkpoint due at ``step``, if any; returns the seconds training was blocked (the
    state gathered and saved, or copied into shared memory), None if no checkpoint was due."""
    last = step == cfg.optim.steps
    persist = step % cfg.ckpt_interval == 0 or last
    if snapshots is None:
        if not persist:
            return None
        t0 = time.perf_counter()
        ref = state.save(cfg, info, step=step, consumed=consumed, model=model, optimizer=optimizer, loss=loss)
        if info.rank == 0:
            events.write({"event": EventKind.CHECKPOINT, "step": step, "path": str(ref.path)})
        return time.perf_counter() - t0
    if not (persist or step % cfg.memory_interval == 0):
        return None
    t0 = time.perf_counter()  # training waits for the state dict to be gathered as well as copied
    st = state.training_state(cfg, info, step=step, consumed=consumed, model=model, optimizer=optimizer, loss=loss)
    if snapshots.snapshot(step, st, persist=persist, wait=last) is None:
        events.write({"event": EventKind.SNAPSHOT_SKIPPED, "rank": info.rank, "step": step, "reason": "slot busy"})
    return time.perf_counter() - t0


def seed_everything(seed: int, device: torch.device) -> None:
    torch.manual_seed(seed)
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True)


def build_model(cfg: JobConfig, device: torch.device) -> tuple[GPT, torch.optim.Optimizer]:
    """The model and its optimizer; under FSDP the model is sharded first (each block, then
    the root, which holds the tied embedding), so the optimizer holds this rank's pieces."""
    model = GPT(cfg.model).to(device)
    if state.is_sharded(cfg):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if not is_initialized():
            raise RuntimeError(
                "cluster.parallelism 'fsdp' needs torch.distributed: start workers through "
                "trainer.launch (or init a process group), or use parallelism 'ddp'"
            )
        mesh = init_device_mesh(
            device.type, (torch.distributed.get_world_size(),)
        )  # the worker's device, not the machine's
        for block in model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr, betas=(0.9, 0.95), eps=1e-8)
    return model, opt


def snapshot_capacity(cfg: JobConfig, rank: int, world_size: int = 1) -> int:
    """Bytes one shared-memory slot needs, known before the model is built: fp32 model (its
    state dict lists the tied embedding twice) + two AdamW moments — on rank 0, where the DDP
    replica is snapshotted, or a 1/world piece (plus a row of rounding per tensor) on every
    FSDP rank; RNG and data position on every rank; room for the layout record."""
    m = cfg.model
    model_bytes = 4 * (m.num_params() + m.vocab_size * m.d_model)
    if state.is_sharded(cfg):
        rounding = 4 * 4 * m.d_model * (12 * m.n_layer + 8)  # at most one (≤ 4·d_model wide) row per tensor
        return 3 * (-(-model_bytes // world_size) + rounding) + (1 << 20)
    return (3 * model_bytes if rank == 0 else 0) + (1 << 20)


def grad_sync(net, model, last: bool):
    """Gradients are reduced on the last micro-step of an optimizer step only."""
    if net is not model:  # DDP
        return nullcontext() if last else net.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(last)
    return nullcontext()


def open_snapshots(cfg: JobConfig, info: DistInfo, capacity: int, shm_ns: str | None, events: JsonLines):
    """The rank's snapshot slots, allocated and touched now (off the training path); None for
    direct checkpoints (no shared memory configured, or too little of it with fallback on)."""
    if not shm_ns:
        return None
    first = info.rank - info.local_rank  # ranks are laid out node by node
    node = {lr: snapshot_capacity(cfg, first + lr, info.world_size) for lr in range(local_world_size())}
    try:
        return SnapshotStore(shm_ns, info.local_rank, info.rank, info.world_size, capacity, node)
    except ShmTooSmall as err:
        if not cfg.shm_fallback:
            raise
        events.write({"event": EventKind.SHM_FALLBACK, "rank": info.rank, "reason": str(err)})
        return None


class NodeExcluded(RuntimeError):
    """A node failed the node check after a restart; the job re-forms without it."""


def recheck_nodes(cfg: JobConfig, info: DistInfo, chaos: WorkerChaos, events: JsonLines) -> None:
    """After an in-job restart, before any state is loaded: the node check among the ranks. If a
    node is excluded, its workers wait for their agent to stop the node; the others leave, so
    their agents re-rendezvous without it."""
    excluded = check_after_restart(cfg, info, chaos.check_delay(), events.write)
    if this_node() in excluded:
        threading.Event().wait()  # the node agent sees the marker and stops this node
    if excluded:
        raise NodeExcluded(
            f"node(s) {sorted(excluded)} failed the node check after a restart; re-forming the job without them"
        )


def wrap(cfg: JobConfig, info: DistInfo, model):
    """What the loop runs the model through: DDP over the current process group (not FSDP, which
    sharded the model when it was built; not a world of one). In a fast recovery's epoch every
    rank holds the same state already (kept, sent by a survivor or restored from one agreed
    step): DDP's broadcast of rank 0's parameters is skipped there (~10 ms of the recovery)."""
    if info.world_size == 1 or state.is_sharded(cfg):
        return model
    return DDP(model, init_sync=info.epoch == 0)


def spike_detector(cfg: JobConfig) -> SpikeDetector:
    return SpikeDetector(**cfg.spike) if cfg.spike else SpikeDetector(50, 0.0, 1)


def train(
    cfg: JobConfig,
    info: DistInfo,
    shm_ns: str | None = None,
    heartbeat: Heartbeat | None = None,
    warm: tuple | None = None,
    peers: Peers | None = None,
) -> int:
    """Train until the stage's last step; returns the final step. With ``shm_ns`` checkpoints
    are flash snapshots persisted by the node's saver; without, they are written directly.
    ``warm``: model and optimizer a warm spare built ahead; ``peers``: the link to the node
    agent's fast recovery (survivors of a lost peer rejoin a new group instead of exiting)."""
    o = cfg.optim
    if warm is None:  # a warm spare seeded before it built its model
        seed_everything(cfg.seed, info.device)
    job_dir = Path(cfg.job_dir)
    events = JsonLines(job_dir / EVENTS)
    metrics = JsonLines(job_dir / METRICS) if info.rank == 0 else None
    beat = heartbeat.beat if heartbeat is not None else (lambda phase, step, collective=False: None)

    def wait_for_spare(drill: int, victim: bool) -> None:
        """Before a drill takes a worker away. Waiting is not a step (its time must not stretch
        the adapted step timeout); the step goes on after it (a hang in the drill is a step's)."""
        peers.wait_for_spare(lambda: beat("startup", step), drill, victim)
        beat("step", step)

    chaos = WorkerChaos(
        cfg.chaos,
        cfg.job_dir,
        info.rank,
        events.write,
        node=this_node(),
        before_loss=wait_for_spare if peers is not None and peers.warm_spares else None,
    )
    spikes = spike_detector(cfg)
    windows_to_skip = skip_windows(cfg)
    accum = o.accum_for(info.world_size)

    if info.restart_count > 0 and info.world_size > 1 and info.epoch == 0:  # not a replacement joining survivors
        recheck_nodes(cfg, info, chaos, events)
    snapshots = open_snapshots(cfg, info, snapshot_capacity(cfg, info.rank, info.world_size), shm_ns, events)
    model, opt = warm or build_model(cfg, info.device)
    interrupt = Interrupt(peers.next_epoch_announced) if peers is not None else None
    if interrupt is not None:  # the agent stops a step that cannot complete as soon as it saw a peer die
        interrupt.install(model)
    # a replacement joining survivors (epoch > 0) takes the state they kept, if they agree on it
    restored = (
        info.epoch > 0 and state.kept_by_survivors(cfg, info, None, model=model, optimizer=opt)
    ) or state.restore(cfg, info, model=model, optimizer=opt, snapshots=snapshots)
    step, consumed = restored.step, restored.consumed
    events.write(
        {
            "event": EventKind.START,
            "rank": info.rank,
            "node": this_node(),
            "world_size": info.world_size,
            "restart_count": info.restart_count,
            "epoch": info.epoch,
            "step": step,
            "source": restored.source,
            "checkpoint": restored.checkpoint,
        }
    )

    net = wrap(cfg, info, model)
    if peers is not None:
        peers.ready(restored, events.write)
    windows = TokenWindows(cfg.local_data(on_progress=lambda: beat("startup", step)), "train", o.seq_len)
    sampler = make_sampler(windows, cfg.mixture, cfg.seed, cfg.stage_index)
    global_batch = info.world_size * o.micro_batch * accum
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if info.device.type == "cuda" else nullcontext()

    stalled = 0.0  # seconds checkpoints blocked training since the last metrics line
    while step < o.steps:
        try:
            beat("step", step)
            chaos.before_step(step + 1)
            beat("step", step, collective=True)  # waiting from here on is waiting for the peers
            t0 = time.perf_counter()
            consumed = skip_past(consumed, windows_to_skip)
            lr = lr_at(step, lr=o.lr, min_lr=o.min_lr, warmup=o.warmup_steps, total=o.steps)
            for group in opt.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=info.device)
            factor = chaos.loss_factor(step + 1)
            for m in range(accum):
                positions = micro_batch_positions(
                    consumed, world=info.world_size, rank=info.rank, micro=o.micro_batch, accum_index=m
                )
                x, y = (t.to(info.device, non_blocking=True) for t in make_batch(windows, sampler, positions))
                with grad_sync(net, model, last=m == accum - 1):
                    with autocast:
                        loss = lm_loss(net(x), y) / accum
                        if factor != 1.0:
                            loss = loss * factor
                    loss.backward()
                loss_sum += loss.detach().float()
            mean_loss = all_reduce_mean(loss_sum).item()
            anomaly = spikes.check(mean_loss)
            if anomaly:  # before the update: the rollback target never contains this step
                err = LossAnomaly(anomaly, step + 1, mean_loss, (consumed, consumed + global_batch))
                if info.rank == 0:
                    record_skip(cfg.job_dir, err)
                    events.write(
                        {
                            "event": EventKind.ANOMALY,
                            "kind": anomaly,
                            "step": step + 1,
                            "loss": repr(mean_loss),
                            "skip": list(err.window),
                        }
                    )
                if not cfg.rollback_in_process:
                    raise err  # the elastic agent restarts the workers, which roll back on start-up
                beat("startup", step)  # restoring, as a restarted worker would
                restored, windows_to_skip = roll_back(
                    cfg,
                    info,
                    err,
                    model=model,
                    optimizer=opt,
                    snapshots=snapshots,
                    spikes=spikes,
                    write_event=events.write,
                )
                step, consumed = restored.step, restored.consumed
                continue
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            consumed += global_batch
            dt = time.perf_counter() - t0
            beat("checkpoint", step)
            record = None
            if metrics is not None and (step % cfg.log_every == 0 or step == o.steps):
                record = {
                    "step": step,
                    "loss": mean_loss,
                    "lr": lr,
                    "grad_norm": float(grad_norm),
                    "step_time": dt,
                    "tokens_per_s": global_batch * o.seq_len / dt,
                    "consumed": consumed,
                    "tokens": consumed * o.seq_len,  # tokens seen in this stage (MLflow: tokens_seen)
                    "world_size": info.world_size,
                    "grad_accum": accum,
                }
            last = step == o.steps
            if record is not None and not last:
                # written before this step's checkpoint: a worker stopped during or right after it resumes from
                # this step and never trains it again, so a line written afterwards would be lost; ``ckpt_block_s``
                # is then the time checkpoints blocked training since the previous line
                metrics.write(record if not stalled else {**record, "ckpt_block_s": stalled})
                stalled = 0.0
            stalled += (
                checkpoint(
                    cfg,
                    info,
                    snapshots,
                    events,
                    step=step,
                    consumed=consumed,
                    model=model,
                    optimizer=opt,
                    loss=mean_loss,
                )
                or 0.0
            )
            if record is not None and last:  # the last line carries the final checkpoint's own blocking
                metrics.write(record if not stalled else {**record, "ckpt_block_s": stalled})
        except RuntimeError as err:
            beat("startup", step)  # not stalled: hearing from the agent whether a peer was lost
            if peers is None or (lost := peers.announced(err)) is None:
                raise
        else:
            continue
        net = loss = None  # the broken group's DDP reducer goes with its wrapper
        info, restored = rejoin(cfg, info, peers, (step, consumed), model=model, optimizer=opt, snapshots=snapshots)
        step, consumed, spikes, windows_to_skip = (
            restored.step,
            restored.consumed,
            spike_detector(cfg),
            skip_windows(cfg),
        )
        net = wrap(cfg, info, model)
        peers.ready(restored, events.write)
        events.write(
            {
                "event": EventKind.REJOINED,
                "rank": info.rank,
                "epoch": info.epoch,
                "lost_ranks": lost["lost"],
                "step": step,
                "interrupted": interrupt.clear(),
            }
        )
    if snapshots is not None:
        beat("checkpoint", step)
        snapshots.flush()
        state.wait_committed(cfg, info, o.steps)
    events.write({"event": EventKind.DONE, "rank": info.rank, "step": step})
    events.close()
    if metrics is not None:
        metrics.close()
    return step
