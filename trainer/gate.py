"""The validation gate as its own process: ``python -m trainer.gate REQUESTS.json``.

For each request (a JSON list, one per checkpoint), validates the checkpoint
(``trainer.evaluate.validate`` with the probe) and, if it is good and asked to, evaluates it;
prints one JSON list of ``{"verdict": {...}, "metrics": {...}}`` on stdout. Running it in a
separate process keeps the orchestrator free of model memory and lets validation overlap
training; one process judges every pending checkpoint, so torch is imported once. A request::

    {"location": ".../step_00000040", "model": {ModelConfig fields}, "options": {storage options},
     "probe": {"data_dir": ..., "seq_len": ..., "windows": 16, "tolerance": 0.5} | null,
     "evaluate": {"data_dir": ..., "seq_len": ..., "batches": 16} | null}
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from trainer.config import ModelConfig
from trainer.evaluate import Probe, evaluate_model, validate_and_load
from trainer.process import exit_when_orphaned


def run(request: dict) -> dict:
    model_cfg = ModelConfig(**request["model"])
    probe = Probe(**request["probe"]) if request.get("probe") else None
    verdict, model = validate_and_load(request["location"], model_cfg, request.get("options"), probe)
    out = {"verdict": verdict.to_dict(), "metrics": {}}
    ev = request.get("evaluate")
    if verdict.ok and ev:  # the model validate loaded: the checkpoint is read once
        out["metrics"] = evaluate_model(model, ev["data_dir"], ev["seq_len"], max_batches=ev.get("batches", 16))
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m trainer.gate REQUESTS.json", file=sys.stderr)
        return 2
    exit_when_orphaned()  # started by `pretrain run`: never outlive it
    torch.set_num_threads(1)  # overlaps training: take one core, not all of them
    print(json.dumps([run(request) for request in json.loads(Path(args[0]).read_text())]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
