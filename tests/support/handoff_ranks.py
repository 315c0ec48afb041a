"""One rank of the hand-over test over a real process group (``tests/scenarios/test_handoff.py`` starts
three, with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set): ``python tests/support/handoff_ranks.py
handoff DIR``. Rank 0 is the survivor whose state is handed over, rank 1 a replacement built
fresh (another initialisation, no optimizer state), rank 2 a survivor that keeps its own state.
Each writes a digest of its model and optimizer before and after."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a script: tests/ on the path, for support.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.jobs import tiny_job, trained
from trainer.checkpoint.handoff import hand_over, signature
from trainer.dist import broadcast_object, init_distributed, shutdown_and_exit
from trainer.loop import build_model


def digest(model, opt) -> str:
    h = hashlib.sha256()
    for part in (model.state_dict(), opt.state_dict()["state"]):
        for t in torch.utils._pytree.tree_leaves(part):
            h.update(t.numpy().tobytes() if isinstance(t, torch.Tensor) else repr(t).encode())
    return h.hexdigest()


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    info = init_distributed("gloo", timeout_s=60)
    cfg = tiny_job(root, vocab_size=20_000)  # an embedding over 1 MiB: one tensor travels as it is, the rest packed
    if info.rank == 1:
        torch.manual_seed(5)
        model, opt = build_model(cfg, torch.device("cpu"))
    else:
        model, opt = trained(cfg, steps=2 + info.rank)
    before = digest(model, opt)
    sig = broadcast_object(signature(model, opt, "gloo") if info.rank == 0 else None, src=0)
    hand_over(info.rank, 0, [1], model, opt, "gloo", sig)
    (root / f"result_{mode}_{info.rank}.json").write_text(json.dumps({"before": before, "after": digest(model, opt)}))
    shutdown_and_exit(0)


if __name__ == "__main__":
    main()
