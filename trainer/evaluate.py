"""Checkpoint validation and evaluation, runnable in any process with torch (no prefect).

``validate`` answers "may training resume from this checkpoint?": the manifest is complete,
every shard matches its sha256, every shard loads with ``weights_only=True``, the model state
(whole, or reassembled from the ranks' FSDP pieces) fits the model, optimizer and data position
are present, every tensor is finite, and (with a :class:`Probe`) the loss on a fixed held-out
batch is within a tolerance of the training loss.
``evaluate`` computes validation loss, perplexity and next-token accuracy.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from trainer.checkpoint import store as ckpt
from trainer.checkpoint.records import DamagedRecord
from trainer.checkpoint.sharded import ShardLayoutError, consolidate, load_full_state
from trainer.data.sampler import DataError, TokenWindows
from trainer.job.config import ModelConfig
from trainer.model import GPT, lm_loss
from trainer.storage import NotFound, StorageError

EVAL_BATCH_SIZE = 8  # sequences per evaluation batch (``validation.eval_batches`` counts these batches)


@dataclass
class Verdict:
    ok: bool
    step: int | None
    problems: list[str] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)  # probe_loss, train_loss when probed

    def to_dict(self) -> dict:
        return asdict(self)


def iter_tensors(obj):
    """Every tensor in a nested state (dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)


@dataclass(frozen=True)
class Probe:
    """The probe of the validation gate: the loss on a fixed held-out batch (the first windows of
    the validation split) must not exceed the training loss recorded at the checkpoint's step by
    more than ``tolerance`` (relative). Catches diverged or scrambled weights that are finite."""

    data_dir: str
    seq_len: int
    windows: int  # validation.probe_windows
    tolerance: float  # validation.probe_tolerance


def validate(
    location: str | Path, model_cfg: ModelConfig, options: dict | None = None, probe: Probe | None = None
) -> Verdict:
    """Validate the checkpoint at ``location`` (``…/step_XXXXXXXX``, local or s3://)."""
    return validate_and_load(location, model_cfg, options, probe)[0]


def validate_and_load(
    location: str | Path, model_cfg: ModelConfig, options: dict | None = None, probe: Probe | None = None
) -> tuple[Verdict, GPT | None]:
    """:func:`validate`, also returning the checkpoint's model when it loaded (so a caller
    that evaluates next does not read the checkpoint again)."""
    store, step = ckpt.CheckpointStore.of_step(location, options)
    problems = store.verify(step)
    if problems:
        return Verdict(False, step, problems), None
    try:
        manifest = store.manifest(step)
    except DamagedRecord as err:  # rewritten since verify read it
        return Verdict(False, step, [str(err)]), None
    if manifest is None:  # deleted (pruned) since verify read it
        return Verdict(
            False, step, [f"{ckpt.step_name(step)}: no {ckpt.MANIFEST} (deleted while being validated)"]
        ), None
    shards = {}
    for name in manifest.files:
        try:
            shards[name] = store.load_shard(step, name)
        except Exception as err:  # noqa: BLE001 - any load failure makes the checkpoint unusable
            problems.append(f"{name}: cannot be loaded with weights_only=True ({err.__class__.__name__}: {err})")
    model_files = ckpt.model_files(list(manifest.files), manifest.world_size)
    what = model_files[0] if len(model_files) == 1 else f"the {len(model_files)} model shards"
    main, model = None, None
    if not model_files:
        problems.append(
            f"no model state: neither {ckpt.MODEL_SHARD} nor a model shard of every rank "
            f"(world_size {manifest.world_size}) is in the manifest"
        )
    elif all(n in shards for n in model_files):
        for name in model_files:
            for key in ("model", "optimizer", "scheduler", "step"):
                if key not in shards[name]:
                    problems.append(f"{name}: no {key!r} state")
        try:  # a sharded (FSDP) checkpoint is reassembled: its pieces must fit together
            main = shards[model_files[0]] if len(model_files) == 1 else consolidate([shards[n] for n in model_files])
        except (ShardLayoutError, KeyError, RuntimeError) as err:
            problems.append(f"{what}: the rank pieces do not reassemble ({str(err)[:300]})")
    if main is not None and "model" in main:
        try:
            model = GPT(model_cfg)
            model.load_state_dict(main["model"])
        except RuntimeError as err:
            model = None
            problems.append(f"{what}: model state does not fit the spec's model ({str(err)[:300]})")
    rank_shards = [s for n, s in shards.items() if n not in model_files]
    if not any("consumed" in s for s in rank_shards):
        problems.append("no rank shard with a data position")
    for name, shard in shards.items():
        bad = sum(1 for t in iter_tensors(shard) if t.is_floating_point() and not torch.isfinite(t).all())
        if bad:
            problems.append(f"{name}: {bad} tensor(s) hold NaN/Inf")
    metrics = {}
    if probe is not None and model is not None and not problems:
        train_loss = next((float(s["loss"]) for s in rank_shards if s.get("loss") is not None), None)
        probe_loss = held_out_loss(model, probe.data_dir, probe.seq_len, probe.windows)["loss"]
        metrics = {"probe_loss": probe_loss, "train_loss": train_loss}
        if not math.isfinite(probe_loss):
            problems.append(f"probe loss on the held-out batch is {probe_loss}")
        elif train_loss is not None and probe_loss > train_loss * (1 + probe.tolerance):
            problems.append(
                f"probe loss {probe_loss:.4f} on the held-out batch exceeds the training loss "
                f"{train_loss:.4f} at step {step} by more than {probe.tolerance:.0%} (diverged or damaged weights)"
            )
    return Verdict(not problems, step, problems, metrics), model


def load_model(location: str | Path, model_cfg: ModelConfig, options: dict | None = None) -> tuple[GPT, int]:
    """The checkpoint's model (eval mode) and its step."""
    store, step = ckpt.CheckpointStore.of_step(location, options)
    model = GPT(model_cfg)
    model.load_state_dict(load_full_state(store, step)["model"])  # whole, or reassembled from FSDP shards
    return model.eval(), step


@torch.no_grad()
def held_out_loss(
    model: GPT, data_dir: str | Path, seq_len: int, windows: int, batch_size: int = EVAL_BATCH_SIZE
) -> dict:
    """Loss and next-token accuracy over the first ``windows`` windows of the validation split
    (a fixed batch: the same for every checkpoint, so results compare across steps)."""
    model.eval()
    split = TokenWindows(data_dir, "val", seq_len)
    n = min(len(split), windows)
    total_loss, correct, tokens = 0.0, 0, 0
    for start in range(0, n, batch_size):
        rows = torch.stack([split[i] for i in range(start, min(n, start + batch_size))])
        x, y = rows[:, :-1], rows[:, 1:]
        logits = model(x)
        total_loss += lm_loss(logits, y).item() * y.numel()
        correct += (logits.argmax(-1) == y).sum().item()
        tokens += y.numel()
    return {"loss": total_loss / tokens, "accuracy": correct / tokens, "tokens": tokens}


def evaluate(
    location: str | Path,
    model_cfg: ModelConfig,
    data_dir: str | Path,
    seq_len: int,
    *,
    max_batches: int,
    batch_size: int = EVAL_BATCH_SIZE,
    options: dict | None = None,
) -> dict:
    """Validation-split loss, perplexity and next-token accuracy of the checkpoint's model, over
    its first ``max_batches`` batches."""
    return evaluate_model(
        load_model(location, model_cfg, options)[0], data_dir, seq_len, max_batches=max_batches, batch_size=batch_size
    )


def evaluate_model(
    model: GPT, data_dir: str | Path, seq_len: int, *, max_batches: int, batch_size: int = EVAL_BATCH_SIZE
) -> dict:
    """Validation-split loss, perplexity and next-token accuracy of a loaded model."""
    r = held_out_loss(model, data_dir, seq_len, batch_size * max_batches, batch_size)
    return {
        "val_loss": r["loss"],
        "val_perplexity": math.exp(min(r["loss"], 50.0)),
        "val_accuracy": r["accuracy"],
        "val_tokens": r["tokens"],
    }


# failures that say nothing about the checkpoint: judge it again later
NOT_THE_CHECKPOINTS = (StorageError, DataError, OSError, MemoryError)


@dataclass(frozen=True)
class GateRequest:
    """One request of the gate's request file (``trainer.gate``), parsed once."""

    location: str
    model: ModelConfig
    options: dict | None
    probe: Probe | None
    evaluate: dict | None  # {"data_dir", "seq_len", "batches"}: the metrics of a good checkpoint

    @classmethod
    def parse(cls, request: dict) -> GateRequest:
        """Raises (KeyError, TypeError, ValueError) on a request this release cannot read."""
        ev = request.get("evaluate")
        if ev:
            ev = {"data_dir": ev["data_dir"], "seq_len": int(ev["seq_len"]), "batches": int(ev["batches"])}
        return cls(
            str(request["location"]),
            ModelConfig(**request["model"]),
            request.get("options"),
            Probe(**request["probe"]) if request.get("probe") else None,
            ev or None,
        )


def judge(request: GateRequest) -> dict:
    """Judge one gate request: the verdict and, when good and asked, the metrics (raises what
    validation raises; :func:`judge_one` never does)."""
    verdict, model = validate_and_load(request.location, request.model, request.options, request.probe)
    out = {"verdict": verdict.to_dict(), "metrics": {}}
    ev = request.evaluate
    if verdict.ok and ev:  # the model validate loaded: the checkpoint is read once
        out["metrics"] = evaluate_model(model, ev["data_dir"], ev["seq_len"], max_batches=ev["batches"])
    return out


def _bad(*problems: str) -> dict:
    return {"verdict": Verdict(False, None, list(problems)).to_dict(), "metrics": {}}


def judge_one(request: dict) -> dict:
    """:func:`judge`, never raising: a failure of the checkpoint (a damaged record, a vanished
    file, anything else its validation raises) is a bad verdict; a failure of the surroundings
    (storage, the probe's data, a malformed request) leaves it unjudged, for the next pass."""
    try:
        parsed = GateRequest.parse(request)
    except Exception as err:  # noqa: BLE001 - the orchestrator's request, not the checkpoint
        return {"unjudged": f"malformed gate request ({type(err).__name__}: {err})"}
    where = parsed.location
    try:
        return judge(parsed)
    except DamagedRecord as err:
        return _bad(str(err))
    except NotFound as err:
        return _bad(f"{where}: {err}")
    except NOT_THE_CHECKPOINTS as err:
        return {"unjudged": f"{where}: {type(err).__name__}: {err}"}
    except Exception as err:  # noqa: BLE001 - validation failed on this checkpoint's content
        return _bad(f"validating {where} raised {type(err).__name__}: {str(err)[:500]}")
