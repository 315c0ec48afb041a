"""The training loop of one stage, run by every worker of the job: ``train`` steps a ``Trainer``
(the rank's state) to the stage's last step, rolling back after a loss anomaly and, when a peer
is lost, rejoining the survivors' next group."""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.checkpoint import state
from trainer.checkpoint.checkpointer import Checkpointer, open_snapshots
from trainer.checkpoint.checkpointer import checkpoint as checkpoint  # imported from here by tests
from trainer.checkpoint.sizing import snapshot_capacity
from trainer.data.cache import job_data
from trainer.data.sampler import TokenWindows, make_batch, make_sampler, micro_batch_positions
from trainer.dist import DistInfo, all_reduce_mean, is_initialized
from trainer.job.config import JobConfig
from trainer.job.events import EventKind
from trainer.job.reporting import JsonLines
from trainer.model import GPT, lm_loss, lr_at, param_groups
from trainer.resilience import rollback
from trainer.resilience.anomaly import LossAnomaly, SpikeDetector, record_skip, skip_past
from trainer.resilience.chaos import WorkerChaos
from trainer.resilience.heartbeat import Heartbeat
from trainer.resilience.nodecheck import check_after_restart, this_node
from trainer.resilience.peers import Peers
from trainer.resilience.peers import rejoin as rejoin_survivors
from trainer.resilience.survivor_interrupt import Interrupt


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
    opt = torch.optim.AdamW(param_groups(model, cfg.stage.weight_decay), lr=cfg.stage.lr, betas=(0.9, 0.95), eps=1e-8)
    return model, opt


def grad_sync(net, model, last: bool):
    """Gradients are reduced on the last micro-step of an optimizer step only."""
    if net is not model:  # DDP
        return nullcontext() if last else net.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(last)
    return nullcontext()


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
    ft = cfg.fault_tolerance
    return SpikeDetector(ft.spike_window, ft.spike_zscore, ft.spike_min_steps)


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
    trainer = Trainer(cfg, info, shm_ns, heartbeat, warm, peers)
    while trainer.step < cfg.stage.steps:
        try:
            try:
                loss = trainer.train_step()
            except LossAnomaly as err:
                trainer.roll_back(err)  # in process, or raised again for the agent to restart the workers
                continue
            trainer.after_step(loss)
        except RuntimeError as err:
            trainer.beat("startup", trainer.step)  # not stalled: hearing from the agent whether a peer was lost
            if peers is None or (lost := peers.announced(err)) is None:
                raise
        else:
            continue
        trainer.rejoin(lost)
    return trainer.finish()


class Trainer:
    """One rank's run of a stage: what ``train`` steps through, set up as the worker starts (its
    state restored) and kept across a rollback or a survivor's rejoin."""

    def __init__(
        self,
        cfg: JobConfig,
        info: DistInfo,
        shm_ns: str | None = None,
        heartbeat: Heartbeat | None = None,
        warm: tuple | None = None,
        peers: Peers | None = None,
    ):
        if warm is None:  # a warm spare seeded before it built its model
            seed_everything(cfg.seed, info.device)
        self.cfg, self.info, self.peers = cfg, info, peers
        self.events = JsonLines(cfg.layout.events)
        self.metrics = JsonLines(cfg.layout.metrics) if info.rank == 0 else None
        self.beat = heartbeat.beat if heartbeat is not None else (lambda phase, step, collective=False: None)
        self.chaos = WorkerChaos(
            cfg.chaos,
            cfg.job_dir,
            info.rank,
            self.events.write,
            node=this_node(),
            before_loss=self.wait_for_spare if peers is not None and peers.warm_spares else None,
        )
        self.spikes = spike_detector(cfg)
        self.windows_to_skip = rollback.skip_windows(cfg)
        self.accum = cfg.stage.accum_for(info.world_size)

        if info.restart_count > 0 and info.world_size > 1 and info.epoch == 0:  # not a replacement joining survivors
            recheck_nodes(cfg, info, self.chaos, self.events)
        self.snapshots = open_snapshots(
            cfg, info, snapshot_capacity(cfg, info.rank, info.world_size), shm_ns, self.events
        )
        self.model, self.optimizer = warm or build_model(cfg, info.device)
        self.checkpointer = Checkpointer(
            cfg, info, self.snapshots, self.events, model=self.model, optimizer=self.optimizer
        )
        self.interrupt = Interrupt(peers.next_epoch_announced) if peers is not None else None
        if self.interrupt is not None:  # the agent stops a step that cannot complete as soon as it saw a peer die
            self.interrupt.install(self.model)
        self.start()

    def start(self) -> None:
        """The state to train from (restored), the model's wrapper, the data."""
        cfg, info, o = self.cfg, self.info, self.cfg.stage
        # a replacement joining survivors (epoch > 0) takes the state they kept, if they agree on it
        restored = (
            info.epoch > 0 and state.kept_by_survivors(cfg, info, None, model=self.model, optimizer=self.optimizer)
        ) or state.restore(cfg, info, model=self.model, optimizer=self.optimizer, snapshots=self.snapshots)
        self.step, self.consumed = restored.step, restored.consumed
        self.events.write(
            {
                "event": EventKind.START,
                "rank": info.rank,
                "node": this_node(),
                "world_size": info.world_size,
                "restart_count": info.restart_count,
                "epoch": info.epoch,
                "step": self.step,
                "source": restored.source,
                "checkpoint": restored.checkpoint,
            }
        )

        self.net = wrap(cfg, info, self.model)
        if self.peers is not None:
            self.peers.ready(restored, self.events.write)
        data = job_data(cfg, on_progress=lambda: self.beat("startup", self.step))
        self.windows = TokenWindows(data, "train", o.seq_len)
        self.sampler = make_sampler(self.windows, cfg.stage.mixture, cfg.seed, cfg.stage.index)
        self.global_batch = info.world_size * o.micro_batch * self.accum
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if info.device.type == "cuda" else nullcontext()
        self.lr = self.grad_norm = self.step_time = None  # the last step's, for its metrics line
        self.stalled = 0.0  # seconds checkpoints blocked training since the last metrics line

    def wait_for_spare(self, drill: int, victim: bool) -> None:
        """Before a drill takes a worker away. Waiting is not a step (its time must not stretch
        the adapted step timeout); the step goes on after it (a hang in the drill is a step's)."""
        self.peers.wait_for_spare(lambda: self.beat("startup", self.step), drill, victim)
        self.beat("step", self.step)

    def train_step(self) -> float:
        """One optimizer step: the learning rate, the micro-batches (gradients reduced on the last),
        the loss averaged over the ranks, the update; returns the mean loss. A loss anomaly is
        raised (``LossAnomaly``) before the update."""
        info, o, step = self.info, self.cfg.stage, self.step
        self.beat("step", step)
        self.chaos.before_step(step + 1)
        self.beat("step", step, collective=True)  # waiting from here on is waiting for the peers
        t0 = time.perf_counter()
        self.consumed = skip_past(self.consumed, self.windows_to_skip)
        self.lr = lr_at(step, lr=o.lr, min_lr=o.min_lr, warmup=o.warmup_steps, total=o.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        loss_sum = torch.zeros((), device=info.device)
        factor = self.chaos.loss_factor(step + 1)
        for m in range(self.accum):
            positions = micro_batch_positions(
                self.consumed, world=info.world_size, rank=info.rank, micro=o.micro_batch, accum_index=m
            )
            x, y = (t.to(info.device, non_blocking=True) for t in make_batch(self.windows, self.sampler, positions))
            with grad_sync(self.net, self.model, last=m == self.accum - 1):
                with self.autocast:
                    loss = lm_loss(self.net(x), y) / self.accum
                    if factor != 1.0:
                        loss = loss * factor
                loss.backward()
            loss_sum += loss.detach().float()
        mean_loss = all_reduce_mean(loss_sum).item()
        anomaly = self.spikes.check(mean_loss)
        if anomaly:  # before the update: the rollback target never contains this step
            raise self.anomaly(anomaly, mean_loss)
        self.grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), o.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.consumed += self.global_batch
        self.step_time = time.perf_counter() - t0
        return mean_loss

    def anomaly(self, kind: str, loss: float) -> LossAnomaly:
        """The anomaly of the step being trained; rank 0 records its samples to skip and reports it."""
        err = LossAnomaly(kind, self.step + 1, loss, (self.consumed, self.consumed + self.global_batch))
        if self.info.rank == 0:
            record_skip(self.cfg.job_dir, err)
            self.events.write(
                {
                    "event": EventKind.ANOMALY,
                    "kind": kind,
                    "step": self.step + 1,
                    "loss": repr(loss),
                    "skip": list(err.window),
                }
            )
        return err

    def after_step(self, loss: float) -> None:
        """The step's metrics line (rank 0, every ``log_every`` steps and at the last) and the
        checkpoint, if the checkpointer finds one due."""
        cfg, step = self.cfg, self.step
        self.beat("checkpoint", step)
        record = None
        if self.metrics is not None and (step % cfg.tracking.log_every == 0 or step == cfg.stage.steps):
            record = self.record(loss)
        last = step == cfg.stage.steps
        if record is not None and not last:
            # written before this step's checkpoint: a worker stopped during or right after it resumes from
            # this step and never trains it again, so a line written afterwards would be lost; ``ckpt_block_s``
            # is then the time checkpoints blocked training since the previous line
            self.log(record)
        self.stalled += self.checkpointer.save(step, consumed=self.consumed, loss=loss) or 0.0
        if record is not None and last:  # the last line carries the final checkpoint's own blocking
            self.log(record)

    def record(self, loss: float) -> dict:
        """The metrics line of the step just trained."""
        o, dt = self.cfg.stage, self.step_time
        return {
            "step": self.step,
            "loss": loss,
            "lr": self.lr,
            "grad_norm": float(self.grad_norm),
            "step_time": dt,
            "tokens_per_s": self.global_batch * o.seq_len / dt,
            "consumed": self.consumed,
            "tokens": self.consumed * o.seq_len,  # tokens seen in this stage (MLflow: tokens_seen)
            "world_size": self.info.world_size,
            "grad_accum": self.accum,
        }

    def log(self, record: dict) -> None:
        self.metrics.write(record if not self.stalled else {**record, "ckpt_block_s": self.stalled})
        self.stalled = 0.0

    def roll_back(self, err: LossAnomaly) -> None:
        """After a loss anomaly: every rank back to the newest state before it, the anomaly's samples
        skipped from now on; or ``err`` raised again when the workers are to be restarted."""
        if not self.cfg.fault_tolerance.rollback_in_process:
            raise err  # the elastic agent restarts the workers, which roll back on start-up
        self.beat("startup", self.step)  # restoring, as a restarted worker would
        restored, self.windows_to_skip = rollback.roll_back(
            self.cfg,
            self.info,
            err,
            model=self.model,
            optimizer=self.optimizer,
            snapshots=self.snapshots,
            spikes=self.spikes,
            write_event=self.events.write,
        )
        self.step, self.consumed = restored.step, restored.consumed

    def rejoin(self, lost: dict) -> None:
        """A survivor's part of a fast recovery (``lost``: the agent's record of the next epoch): the
        next epoch's group, the state every rank agrees on, the model wrapped for the new group."""
        self.net = None  # the broken group's DDP reducer goes with its wrapper
        self.info, restored = rejoin_survivors(
            self.cfg,
            self.info,
            self.peers,
            (self.step, self.consumed),
            model=self.model,
            optimizer=self.optimizer,
            snapshots=self.snapshots,
        )
        self.step, self.consumed, self.spikes, self.windows_to_skip = (
            restored.step,
            restored.consumed,
            spike_detector(self.cfg),
            rollback.skip_windows(self.cfg),
        )
        self.checkpointer.info = self.info  # checkpoints are the new group's
        self.net = wrap(self.cfg, self.info, self.model)
        self.peers.ready(restored, self.events.write)
        self.events.write(
            {
                "event": EventKind.REJOINED,
                "rank": self.info.rank,
                "epoch": self.info.epoch,
                "lost_ranks": lost["lost"],
                "step": self.step,
                "interrupted": self.interrupt.clear(),
            }
        )

    def finish(self) -> int:
        """After the last step: the snapshots persisted and committed, the run's last event; the final step."""
        if self.snapshots is not None:
            self.beat("checkpoint", self.step)
            self.checkpointer.flush()
        self.events.write({"event": EventKind.DONE, "rank": self.info.rank, "step": self.step})
        self.events.close()
        if self.metrics is not None:
            self.metrics.close()
        return self.step
