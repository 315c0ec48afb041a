"""One rank of the FSDP state tests (``tests/scenarios/test_fsdp.py`` starts it once per rank, with
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set): ``python tests/support/fsdp_ranks.py MODE DIR``.

``train`` (world 2): train 3 steps, checkpoint step 3 to storage (direct save), train a 4th
step and snapshot it to shared memory; then restore fresh models from memory and from storage,
and the live model (gone on to step 5) from memory as an in-process rollback does, and check
them against what was saved, bit for bit. Writes the full step-3 model for the test.
``reshard`` (any world): restore the step-3 FSDP checkpoint, and start from the DDP copy of
it (``DIR/ddp_ckpt``, written by the test), in FSDP models of this world size; write each
rank's pieces and the restore sources.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a script: tests/ on the path, for support.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.jobs import tiny_job
from trainer.checkpoint import state
from trainer.checkpoint.flash import SnapshotStore
from trainer.checkpoint.sharded import localize
from trainer.dist import init_distributed, shutdown_and_exit
from trainer.job.config import JobConfig
from trainer.loop import build_model, seed_everything, snapshot_capacity
from trainer.model import lm_loss


def job(root: Path, parallelism: str = "fsdp") -> JobConfig:
    # vocab 65 and 33 positions: the embeddings split unevenly (33 + 32 and 17 + 16 rows)
    return tiny_job(root, parallelism=parallelism, vocab_size=65, max_seq_len=33, steps=10, lr=1e-2, min_lr=1e-3)


MODEL = job(Path(".")).model


def train_step(model, opt, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(0, MODEL.vocab_size, (2, 9), generator=g)
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def pieces(model, opt) -> dict:
    """This rank's pieces of model and optimizer, copied."""

    def copy(obj):
        if isinstance(obj, torch.Tensor):
            return obj.detach().clone()
        if isinstance(obj, dict):
            return {k: copy(v) for k, v in obj.items()}
        return obj

    return copy({"model": localize(model.state_dict()), "optimizer": localize(opt.state_dict())})


def same(a, b, where="state") -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def fresh(cfg: JobConfig, seed: int):
    torch.manual_seed(seed)  # other initial values than the trained model's
    return build_model(cfg, torch.device("cpu"))


def full_model(model) -> dict:
    """The full parameters (a collective: every rank calls it)."""
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def main(mode: str, root: Path) -> None:
    info = init_distributed("gloo")
    cfg = job(root)
    out = {}
    if mode == "train":
        seed_everything(cfg.seed, info.device)
        model, opt = build_model(cfg, info.device)
        for step in (1, 2, 3):
            train_step(model, opt, info.rank, step)
        at3 = pieces(model, opt)
        state.save(cfg, info, step=3, consumed=12, model=model, optimizer=opt)
        full3 = full_model(model)
        if info.rank == 0:
            torch.save(full3, root / "full_step3.pt")
        train_step(model, opt, info.rank, 4)
        snaps = SnapshotStore(
            root / "shm",
            info.local_rank,
            info.rank,
            info.world_size,
            snapshot_capacity(cfg, info.rank, info.world_size),
        )
        snaps.snapshot(
            4, state.training_state(cfg, info, step=4, consumed=16, model=model, optimizer=opt), persist=False
        )
        snaps.flush()
        at4 = pieces(model, opt)

        m, o = fresh(cfg, seed=7)
        got = state.restore(cfg, info, model=m, optimizer=o, snapshots=snaps)
        same(pieces(m, o), at4)
        train_step(m, o, info.rank, 5)  # the restored optimizer steps on like the original
        train_step(model, opt, info.rank, 5)
        same(pieces(m, o), pieces(model, opt))
        out["memory"] = [got.source, got.step, got.consumed]

        # an in-process rollback: step 4's snapshot restored into the live model, which has gone on to step 5
        got = state.restore(cfg, info, model=model, optimizer=opt, snapshots=snaps)
        same(pieces(model, opt), at4)
        train_step(model, opt, info.rank, 5)
        same(pieces(model, opt), pieces(m, o))
        out["live"] = [got.source, got.step, got.consumed]

        m, o = fresh(cfg, seed=8)
        got = state.restore(cfg, info, model=m, optimizer=o, snapshots=None)
        same(pieces(m, o), at3)
        out["storage"] = [got.source, got.step, got.consumed]
    elif mode == "reshard":  # this rank's pieces after restoring at this world size
        for name, run in (
            ("fsdp", cfg),
            (
                "ddp",
                cfg.amended(
                    checkpoint={"location": str(root / f"fsdp_from_ddp_{info.world_size}")},
                    stage={"init_from": str(root / "ddp_ckpt" / "step_00000003")},
                ),
            ),
        ):
            m, o = fresh(run, seed=9)
            got = state.restore(run, info, model=m, optimizer=o)
            torch.save(pieces(m, o), root / f"resharded_from_{name}_{info.world_size}_{info.rank}.pt")
            out[name] = [got.source, got.step, got.consumed]
    (root / f"result_{mode}_{info.rank}.json").write_text(json.dumps(out))
    shutdown_and_exit(0)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
