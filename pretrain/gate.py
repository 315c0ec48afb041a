"""The validation gate, orchestrator side (no Prefect): judge committed checkpoints in a
separate process, record the verdict next to the checkpoint, and rewind a stage past bad ones.

Only a checkpoint the gate judged *good* becomes the stage's resume point after a failed job.
A bad one is never resumed from: it is kept (for forensics) and, if training has to go back
past it, moved to ``quarantine/`` so that step can be committed again.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

from pretrain.jobs import checkpoint_store, model_config, storage_options
from pretrain.layout import CampaignLayout
from pretrain.spec import CampaignSpec
from trainer.checkpoint import CheckpointStore, step_name
from trainer.data import read_manifest

GATE_TIMEOUT_S = 600.0


class GateError(RuntimeError):
    """The validation process itself failed (not a verdict on the checkpoint)."""


def gate_request(spec: CampaignSpec, stage_index: int, location: str, evaluate: bool) -> dict:
    data_dir = str(CampaignLayout(spec.workdir_path).data_dir)
    seq_len, v = spec.stages[stage_index].seq_len, spec.validation
    return {
        "location": location, "options": storage_options(spec),
        "model": asdict(model_config(spec, read_manifest(data_dir)["vocab_size"])),
        "probe": {"data_dir": data_dir, "seq_len": seq_len, "windows": v.probe_windows, "tolerance": v.probe_tolerance},
        "evaluate": {"data_dir": data_dir, "seq_len": seq_len, "batches": v.eval_batches} if evaluate else None,
    }


def run_gate(requests: list[dict], timeout_s: float = GATE_TIMEOUT_S, env: dict[str, str] | None = None) -> list[dict]:
    """Run ``python -m trainer.gate`` on the requests; one ``{"verdict", "metrics"}`` each. ``env``:
    the process's environment (credentials travel there, never in the request file)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="pretrain-gate-") as f:
        json.dump(requests, f)
        f.flush()
        proc = subprocess.run([sys.executable, "-m", "trainer.gate", f.name], capture_output=True, text=True,
                              timeout=timeout_s, env=env)
    if proc.returncode != 0:
        where = ", ".join(r["location"] for r in requests)
        raise GateError(f"validating {where} failed to run (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def judge(spec: CampaignSpec, stage_index: int, steps: list[int], evaluate: set[int] = frozenset()) -> list[dict]:
    """Validate checkpoints of the stage in one gate process (evaluating the good ones among
    ``evaluate``); write each verdict next to its checkpoint (moving the stage's ``good``
    pointer) and return the records, in the order of ``steps``. A step that training's retention
    pruned meanwhile (its manifest is gone and the pointer is elsewhere) gets no record."""
    store = checkpoint_store(spec, spec.stages[stage_index].name)
    locations = [store.ref(step).location for step in steps]
    t0 = time.monotonic()
    outs = run_gate([gate_request(spec, stage_index, loc, step in evaluate) for step, loc in zip(steps, locations)],
                    env=spec.credentials.child_env() if spec.credentials else None)
    gate_s = round((time.monotonic() - t0) / max(1, len(steps)), 2)
    records, pointer = [], store.read_pointer()
    for step, location, out in zip(steps, locations, outs):
        if step != pointer and store.manifest(step) is None:
            continue  # pruned while being judged: no longer a checkpoint, nothing to record
        v = out["verdict"]
        record = {"step": step, "path": location, "verdict": "good" if v["ok"] else "bad", "problems": v["problems"],
                  "probe": v.get("metrics", {}), "metrics": out["metrics"], "gate_s": gate_s, "time": time.time()}
        store.set_verdict(step, record)
        records.append(record)
    return records


def wants_eval(spec: CampaignSpec, stage_index: int, step: int) -> bool:
    """Evaluate every ``validation.eval_every``-th checkpoint during training; the stage's final
    one is evaluated by the campaign's evaluate flow."""
    every = spec.validation.eval_every * spec.checkpoint.interval
    return bool(every) and step % every == 0 and step < spec.stages[stage_index].steps


def rewind_past_bad(store: CheckpointStore) -> dict | None:
    """Make the newest good checkpoint the stage's ``latest`` again: everything the pointer got
    to beyond it is bad (quarantined) or never committed (deleted). Returns what was done, or
    None when the pointer already is at the newest good checkpoint."""
    good, limit = store.latest_good(), store.read_pointer()
    to = good.step if good else None
    if limit is None or (to is not None and limit <= to):
        return None
    quarantined, dropped = [], []
    for step in store.all_steps():
        if (to is None or step > to) and step <= limit:
            if (store.verdict(step) or {}).get("verdict") == "bad":
                quarantined.append({"step": step, "path": store.quarantine(step)})
            else:
                store.storage.delete_prefix(step_name(step))
                dropped.append(step)
    store.rewind(to)
    return {"from": limit, "to": to, "quarantined": quarantined, "dropped": dropped}

