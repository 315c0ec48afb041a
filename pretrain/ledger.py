"""The campaign ledger: a small JSON file in the workdir that says where the campaign stands.

It records what the orchestrator decided and observed (stages done, attempts, restarts,
failures with causes and time lost, MLflow run ids). Checkpoints themselves are the truth for
training progress; the ledger never claims a step that storage does not hold.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from pretrain.jobs import checkpoint_location, storage_options
from pretrain.layout import CampaignLayout
from pretrain.redact import redact, redact_tree
from pretrain.spec import CampaignSpec
from trainer.atomic import atomic_write_json, read_json


class CampaignMismatch(RuntimeError):
    """The workdir belongs to a campaign with a different spec."""


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
        data = read_json(layout.ledger)
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
        atomic_write_json(self.layout.ledger, self.data, sort_keys=False)  # stages stay in order

    def reload(self) -> dict:
        fresh = read_json(self.layout.ledger)
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
