"""The validation gate as its own process: ``python -m trainer.gate REQUESTS.json``.

For each request (a JSON list, one per checkpoint), validates the checkpoint
(``trainer.evaluate.judge_one``: ``validate`` with the probe) and, if it is good and asked to, evaluates it;
prints one JSON list of results on stdout, one per request: ``{"verdict": {...}, "metrics": {...}}``
or, when it could not be judged now for a reason that is not the checkpoint's (storage
unreachable, the probe's data set missing), ``{"unjudged": "why"}``. Each request is judged on
its own: one that fails never stops the others. Running it in a separate process keeps the
orchestrator free of model memory and lets validation overlap training; one process judges
every pending checkpoint, so torch is imported once. A request::

    {"location": ".../step_00000040", "model": {ModelConfig fields}, "options": {storage options},
     "probe": {"data_dir": ..., "seq_len": ..., "windows": ..., "tolerance": ...} | null,
     "evaluate": {"data_dir": ..., "seq_len": ..., "batches": ...} | null}

(every value from the campaign spec's ``validation`` section: ``pretrain.checkpoints.gate.gate_request``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from trainer.common.process import exit_now, exit_when_orphaned
from trainer.evaluate import judge_one


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m trainer.gate REQUESTS.json", file=sys.stderr)
        return 2
    exit_when_orphaned()  # started by `pretrain run`: never outlive it
    torch.set_num_threads(1)  # overlaps training: take one core, not all of them
    print(json.dumps([judge_one(request) for request in json.loads(Path(args[0]).read_text())]))
    return 0


if __name__ == "__main__":
    exit_now(main())  # whoever started it waits for the exit: no module teardown
