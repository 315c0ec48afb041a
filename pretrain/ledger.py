"""The campaign ledger: a small JSON file in the workdir that says where the campaign stands.

It records what the orchestrator decided and observed (stages done, attempts, restarts,
failures with causes and time lost, MLflow run ids). Checkpoints themselves are the truth for
training progress; the ledger never claims a step that storage does not hold.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from pretrain.jobs import checkpoint_location, storage_options
from pretrain.layout import CampaignLayout
from pretrain.redact import redact, redact_tree
from pretrain.spec import CampaignSpec
from trainer.atomic import atomic_write_bytes, atomic_write_json


class CampaignMismatch(RuntimeError):
    """The workdir belongs to a campaign with a different spec."""


class LedgerError(RuntimeError):
    """The ledger cannot be used or recovered as asked; the message says what to do."""


class LedgerDamaged(LedgerError):
    """``ledger.json`` cannot be read; the message names it and how to recover."""


# the ledger's shape: what status, the flows and the report read without checking
_TOP = {"campaign": str, "campaign_id": str, "spec_hash": str, "status": str, "invocations": int, "mlflow": dict,
        "stages": dict}
_STAGE = {"status": str, "steps": int, "checkpoints": str, "attempts": int, "restarts": int, "failures": list,
          "resumes": list}


def _shape_problem(data: object) -> str | None:
    """What is wrong with the ledger's shape, or None."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not a JSON object"
    fields = [(f"{name!r}", data.get(name), kind) for name, kind in _TOP.items()]
    for stage, s in (data.get("stages") or {}).items() if isinstance(data.get("stages"), dict) else ():
        if not isinstance(s, dict):
            return f"stage {stage!r} is not an object"
        fields += [(f"{name!r} of stage {stage!r}", s.get(name), kind) for name, kind in _STAGE.items()]
        if not all(isinstance(v, dict) and v.get("verdict") in ("good", "bad") for v in s.get("verdicts", [])):
            return f"a 'verdict' of stage {stage!r} is not good or bad"
    for what, value, kind in fields:
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{what} is {'missing' if value is None else repr(value)[:60]}, not a {kind.__name__}"
    return None


def _parse(path: Path, data: bytes) -> dict:
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, ValueError) as err:
        raise LedgerDamaged(f"{path} is damaged (not valid JSON: {err})") from None
    if problem := _shape_problem(obj):
        raise LedgerDamaged(f"{path} is damaged ({problem})")
    return obj


def _prev(path: Path) -> Path:
    return path.with_name(path.name + ".prev")


def _read(path: Path) -> dict | None:
    """The ledger at ``path``; None if there is none; LedgerDamaged saying how to recover."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return _parse(path, data)
    except LedgerDamaged as err:
        raise LedgerDamaged(f"{err}. {_recovery(path)}") from None


def _recovery(path: Path) -> str:
    """How to get a usable ledger back, depending on its previous generation."""
    prev = _prev(path)
    try:
        saved = _parse(prev, prev.read_bytes())
    except (OSError, LedgerDamaged) as err:
        why = "it does not exist" if isinstance(err, FileNotFoundError) else str(err)
        return (f"There is no intact previous generation ({prev}: {why}). Move the damaged file aside "
                f"(mv {path} {path}.damaged) and run the campaign again with its spec: training resumes from "
                "its checkpoints; the ledger's history (attempts, failures, verdicts) starts anew")
    return (f"The previous generation {prev} is intact (campaign {saved['campaign']!r}, status {saved['status']!r}): "
            f"restore it with `pretrain recover-ledger --workdir {path.parent}` (the damaged file is kept as "
            f"{path.name}.damaged-<time>), then run the same command again")


def recover_ledger(workdir: str | Path) -> Path:
    """Replace a damaged ``ledger.json`` with its intact previous generation; the damaged file is
    moved aside (``ledger.json.damaged-<time>``), never deleted. Returns where it went. Raises
    :class:`LedgerError` when there is nothing to recover, :class:`LedgerDamaged` when the
    previous generation is not intact either. Hold the campaign lock while calling it."""
    path = CampaignLayout(Path(workdir).expanduser().resolve()).ledger
    try:
        intact = _read(path) is not None
    except LedgerDamaged:
        intact = None
    if intact is not None:
        raise LedgerError(f"{path} is intact: nothing to recover" if intact else
                          f"{path} does not exist: no campaign to recover in {path.parent}")
    prev = _prev(path)
    try:
        data = prev.read_bytes()
        _parse(prev, data)
    except (OSError, LedgerDamaged):
        raise LedgerDamaged(f"{path} is damaged. {_recovery(path)}") from None
    aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
    os.replace(path, aside)
    atomic_write_bytes(path, data)
    return aside


def _new_stage(steps: int, checkpoints: str) -> dict:
    return {"status": "pending", "steps": steps, "checkpoints": checkpoints, "attempts": 0, "restarts": 0, "failures": [],
            "resumes": [], "verdicts": [], "final_checkpoint": None, "good_checkpoint": None, "mlflow_run_id": None,
            "eval": None}


@dataclass
class Ledger:
    layout: CampaignLayout
    data: dict

    @classmethod
    def read(cls, layout: CampaignLayout) -> "Ledger | None":
        """The workdir's ledger; None if it has none; :class:`LedgerDamaged` if it cannot be read."""
        data = _read(layout.ledger)
        return None if data is None else cls(layout, data)

    @classmethod
    def open(cls, spec: CampaignSpec) -> "Ledger":
        """The campaign's ledger, created on first use; refuses a workdir of another spec."""
        layout = CampaignLayout(spec.workdir_path)
        ledger = cls.read(layout)
        if ledger is None:
            ledger = cls(layout, {
                "campaign": spec.name, "campaign_id": uuid.uuid4().hex, "spec_hash": spec.spec_hash(),
                "created": time.time(), "status": "new", "invocations": 0, "data": None, "cluster": None,
                "mlflow": {"tracking_uri": redact(spec.tracking_uri), "experiment": spec.tracking.experiment,
                           "parent_run_id": None},
                "storage_options": redact_tree(storage_options(spec)),
                "stages": {s.name: _new_stage(s.steps, redact(checkpoint_location(spec, s.name))) for s in spec.stages},
            })
        elif ledger.data["spec_hash"] != spec.spec_hash():
            raise CampaignMismatch(
                f"{layout.root} holds campaign {ledger.data['campaign']!r} with spec hash {ledger.data['spec_hash']}, "
                f"but this spec hashes to {spec.spec_hash()}: resume it with its original spec, "
                f"or start a new campaign with --workdir pointing to an empty directory")
        return ledger

    def save(self) -> None:
        """Write the ledger atomically, first keeping the current (intact) one as ``ledger.json.prev``."""
        path = self.layout.ledger
        try:
            current = path.read_bytes()
            _parse(path, current)
        except (FileNotFoundError, LedgerDamaged):
            current = None  # .prev keeps the last intact generation
        if current is not None:
            atomic_write_bytes(_prev(path), current)
        atomic_write_json(path, self.data, sort_keys=False)  # stages stay in order

    def reload(self) -> dict:
        fresh = _read(self.layout.ledger)
        if fresh is not None:
            self.data = fresh
        return self.data

    def mutate(self, change) -> dict:
        """Re-read the file, apply ``change(data)``, write it back: several flows of one
        campaign each hold a Ledger, and none may overwrite the others' updates."""
        change(self.reload())
        self.save()
        return self.data

    def stage(self, name: str) -> dict:
        return self.data["stages"][name]

    def update_stage(self, name: str, **fields) -> dict:
        return self.mutate(lambda d: d["stages"][name].update(fields))["stages"][name]

    def set(self, **fields) -> None:
        self.mutate(lambda d: d.update(fields))

    def append(self, stage: str, key: str, record: dict) -> None:
        self.mutate(lambda d: d["stages"][stage].setdefault(key, []).append({**record, "time": record.get("time", time.time())}))
