"""The validation gate, orchestrator side (no Prefect): judge committed checkpoints in a
separate process, record the verdict next to the checkpoint, and rewind a stage past bad ones.

Only a checkpoint the gate judged *good* becomes the stage's resume point after a failed job.
A bad one is never resumed from: it is kept (for forensics) and, if training has to go back
past it, moved to ``quarantine/`` so that step can be committed again.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from pretrain.data.campaign import validation_data
from pretrain.run.jobs import checkpoint_store, model_config
from pretrain.settings import PretrainSettings
from pretrain.spec.campaign import CampaignSpec
from pretrain.state.guard import check_holds
from pretrain.state.locations import storage_options
from trainer.checkpoint.records import DamagedRecord
from trainer.checkpoint.store import MANIFEST, CheckpointStore, step_name
from trainer.zygote.client import current_zygote, spawn


def gate_timeout_s(total_bytes: int, requests: int, settings: PretrainSettings) -> float:
    """How long a gate process may take for ``requests`` checkpoints of ``total_bytes`` in all."""
    return max(
        settings.gate_timeout_floor_s,
        settings.gate_per_request_s * requests + 2 * total_bytes / settings.gate_min_bytes_per_s,
    )


def gate_request(
    spec: CampaignSpec, stage_index: int, location: str, evaluate: bool, data: tuple[Path, int] | None = None
) -> dict:
    """The gate's request for one checkpoint; ``data``: the local directory of the campaign's data
    set (its validation split) and its vocabulary size (None: looked up, see :func:`validation_data`)."""
    data_dir, vocab = data or validation_data(spec)
    data_dir, seq_len, v = str(data_dir), spec.stages[stage_index].seq_len, spec.validation
    return {
        "location": location,
        "options": storage_options(spec),
        "model": asdict(model_config(spec, vocab)),
        "probe": {"data_dir": data_dir, "seq_len": seq_len, "windows": v.probe_windows, "tolerance": v.probe_tolerance},
        "evaluate": {"data_dir": data_dir, "seq_len": seq_len, "batches": v.eval_batches} if evaluate else None,
    }


def run_gate(requests: list[dict], timeout_s: float, env: dict[str, str] | None = None) -> list[dict]:
    """Run the gate (``trainer.gate``) on the requests in a process of its own; one result each:
    ``{"verdict", "metrics"}``, or ``{"unjudged": why}`` when it could not be judged now (that
    request's validation could not run, or the whole gate process timed out or crashed): no
    verdict, the next pass retries. ``env``: the process's environment (default: this process's
    now; credentials travel there, never in the request file)."""
    with tempfile.TemporaryDirectory(prefix="pretrain-gate-") as tmp:
        files = {name: os.path.join(tmp, name) for name in ("requests.json", "stdout", "stderr")}
        with open(files["requests.json"], "w") as f:
            json.dump(requests, f)
        code = _gate_process(files, timeout_s, dict(os.environ if env is None else env))
        if code is None:
            return [{"unjudged": f"the gate process timed out after {timeout_s:.0f}s; retried on its next pass"}] * len(
                requests
            )
        stdout, stderr = _read(files["stdout"]), _read(files["stderr"])
    try:
        outs = json.loads(stdout.strip().splitlines()[-1]) if code == 0 else None
    except (ValueError, IndexError):
        outs = None
    if not isinstance(outs, list) or len(outs) != len(requests):
        why = f"the gate process failed (exit {code}): {stderr.strip()[-1000:] or 'no error output'}"
        return [{"unjudged": f"{why}; retried on its next pass"}] * len(requests)
    return outs


def _gate_process(files: dict[str, str], timeout_s: float, env: dict[str, str]) -> int | None:
    """The gate's exit code (negative: the signal that ended it), None when it ran out of time
    (then it is killed). ``python -m trainer.gate``, forked from the campaign run's zygote when
    there is one (``trainer.zygote.client``: torch imported once per run, whatever this process's main
    module), else a fresh interpreter (~1.8 CPU-s of imports per gate pass, several passes per stage)."""
    with open(files["stdout"], "wb") as out, open(files["stderr"], "wb") as err:
        proc = spawn(
            "trainer.gate",
            [files["requests.json"]],
            zygote=current_zygote(),
            env=env,
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def _read(path: str) -> str:
    """A file the gate process wrote; empty if it never got to open it (it died before)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _bytes_to_verify(store: CheckpointStore, steps: list[int]) -> int:
    total = 0
    for step in steps:
        try:
            manifest = store.manifest(step)
        except DamagedRecord:
            continue  # judged bad at once
        total += sum(e.bytes for e in manifest.files.values()) if manifest else 0
    return total


def judge(
    spec: CampaignSpec,
    stage_index: int,
    steps: list[int],
    evaluate: set[int] = frozenset(),
    timeout_s: float | None = None,
    settings: PretrainSettings | None = None,
) -> list[dict]:
    """Validate checkpoints of the stage in one gate process (evaluating the good ones among
    ``evaluate``); write each verdict next to its checkpoint (moving the stage's ``good``
    pointer) and return the records, in the order of ``steps``. A step that training's retention
    pruned meanwhile (its manifest is gone and the pointer is elsewhere) gets no record. A step
    the gate could not judge now gets a record with verdict "unjudged" (its reason in
    ``problems``) and nothing written: it stays pending. ``timeout_s``: default scaled with the
    checkpoints' bytes (:func:`gate_timeout_s`; ``settings`` default: this process's environment)."""
    store = checkpoint_store(spec, spec.stages[stage_index].name)
    locations = [store.ref(step).location for step in steps]
    if timeout_s is None:
        timeout_s = gate_timeout_s(_bytes_to_verify(store, steps), len(steps), settings or PretrainSettings.from_env())
    t0 = time.monotonic()
    data = validation_data(spec)  # once per pass
    outs = run_gate(
        [gate_request(spec, stage_index, loc, step in evaluate, data) for step, loc in zip(steps, locations)],
        timeout_s,
        env=spec.credentials.child_env() if spec.credentials else None,
    )
    gate_s = round((time.monotonic() - t0) / max(1, len(steps)), 2)
    records, pointer = [], store.read_pointer()
    for step, location, out in zip(steps, locations, outs):
        if step != pointer and not store.storage.exists(f"{step_name(step)}/{MANIFEST}"):
            continue  # pruned while being judged: no longer a checkpoint, nothing to record
        if "unjudged" in out:
            records.append(
                {
                    "step": step,
                    "path": location,
                    "verdict": "unjudged",
                    "problems": [out["unjudged"]],
                    "probe": {},
                    "metrics": {},
                    "gate_s": gate_s,
                    "time": time.time(),
                }
            )
            continue
        v = out["verdict"]
        record = {
            "step": step,
            "path": location,
            "verdict": "good" if v["ok"] else "bad",
            "problems": v["problems"],
            "probe": v.get("metrics", {}),
            "metrics": out["metrics"],
            "gate_s": gate_s,
            "time": time.time(),
        }
        check_holds(spec)  # a run that lost the campaign's lease must not move `good`
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
    None when the pointer already is at the newest good checkpoint, or when a checkpoint beyond
    it is still unjudged (the gate could not judge it now: it is judged on the next pass, never
    discarded meanwhile)."""
    good, limit = store.latest_good(), store.read_pointer()
    to = good.step if good else None
    if limit is None or (to is not None and limit <= to):
        return None
    if any(to is None or step > to for step in store.unjudged()):
        return None  # the gate could not judge them yet: never discard what may be good
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
