"""The validation gate as its own process: ``python -m trainer.gate REQUESTS.json``.

For each request (a JSON list, one per checkpoint), validates the checkpoint
(``trainer.evaluate.validate`` with the probe) and, if it is good and asked to, evaluates it;
prints one JSON list of results on stdout, one per request: ``{"verdict": {...}, "metrics": {...}}``
or, when it could not be judged now for a reason that is not the checkpoint's (storage
unreachable, the probe's data set missing), ``{"unjudged": "why"}``. Each request is judged on
its own: one that fails never stops the others. Running it in a separate process keeps the
orchestrator free of model memory and lets validation overlap training; one process judges
every pending checkpoint, so torch is imported once. A request::

    {"location": ".../step_00000040", "model": {ModelConfig fields}, "options": {storage options},
     "probe": {"data_dir": ..., "seq_len": ..., "windows": ..., "tolerance": ...} | null,
     "evaluate": {"data_dir": ..., "seq_len": ..., "batches": ...} | null}

(every value from the campaign spec's ``validation`` section: ``pretrain.gate.gate_request``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from trainer.config import ModelConfig
from trainer.data import DataError
from trainer.evaluate import Probe, Verdict, evaluate_model, validate_and_load
from trainer.process import exit_when_orphaned
from trainer.records import DamagedRecord
from trainer.storage import NotFound, StorageError

# failures that say nothing about the checkpoint: judge it again later
NOT_THE_CHECKPOINTS = (StorageError, DataError, OSError, MemoryError)


def run(request: dict) -> dict:
    """Judge one request (raises what validation raises; :func:`judge_one` never does)."""
    model_cfg = ModelConfig(**request["model"])
    probe = Probe(**request["probe"]) if request.get("probe") else None
    verdict, model = validate_and_load(request["location"], model_cfg, request.get("options"), probe)
    out = {"verdict": verdict.to_dict(), "metrics": {}}
    ev = request.get("evaluate")
    if verdict.ok and ev:  # the model validate loaded: the checkpoint is read once
        out["metrics"] = evaluate_model(model, ev["data_dir"], ev["seq_len"], max_batches=ev["batches"])
    return out


def _bad(*problems: str) -> dict:
    return {"verdict": Verdict(False, None, list(problems)).to_dict(), "metrics": {}}


def judge_one(request: dict) -> dict:
    """:func:`run`, never raising: a failure of the checkpoint (a damaged record, a vanished
    file, anything else its validation raises) is a bad verdict; a failure of the surroundings
    (storage, the probe's data, a malformed request) leaves it unjudged, for the next pass."""
    try:
        where = request["location"]
        ModelConfig(**request["model"])
        if request.get("probe"):
            Probe(**request["probe"])
        if request.get("evaluate"):
            int(request["evaluate"]["batches"])
    except Exception as err:  # noqa: BLE001 - the orchestrator's request, not the checkpoint
        return {"unjudged": f"malformed gate request ({type(err).__name__}: {err})"}
    try:
        return run(request)
    except DamagedRecord as err:
        return _bad(str(err))
    except NotFound as err:
        return _bad(f"{where}: {err}")
    except NOT_THE_CHECKPOINTS as err:
        return {"unjudged": f"{where}: {type(err).__name__}: {err}"}
    except Exception as err:  # noqa: BLE001 - validation failed on this checkpoint's content
        return _bad(f"validating {where} raised {type(err).__name__}: {str(err)[:500]}")


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
    sys.exit(main())
