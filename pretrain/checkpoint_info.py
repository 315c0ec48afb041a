"""What evaluating or exporting a checkpoint needs, read from the checkpoint itself.

Every manifest records ``JobConfig.checkpoint_meta()``: the model configuration, the data
directory (tokenizer and validation split) and the stage's sequence length. So a checkpoint
location (local directory or ``s3://…/step_XXXXXXXX``) is enough for ``pretrain eval`` and
``pretrain export``; each value can be overridden (e.g. the data directory on another machine,
or a spec for checkpoints written before manifests described themselves).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pretrain.jobs import client_options, model_config
from pretrain.layout import CampaignLayout
from pretrain.spec import CampaignSpec
from trainer.checkpoint.records import DamagedRecord, Manifest
from trainer.checkpoint.store import MANIFEST, CheckpointStore
from trainer.config import ModelConfig
from trainer.data import DataError, read_manifest


class CheckpointInfoError(ValueError):
    """The checkpoint does not say (and the caller did not give) something that is needed;
    the message names the option that supplies it."""


class CheckpointRejected(RuntimeError):
    """The checkpoint failed validation; ``problems`` says why."""

    def __init__(self, location: str, problems: list[str]):
        self.location, self.problems = location, list(problems)
        super().__init__(f"checkpoint {location} failed validation: " + "; ".join(self.problems))


@dataclass(frozen=True)
class CheckpointInfo:
    location: str  # …/step_XXXXXXXX, local or s3://
    step: int
    model: ModelConfig
    data_dir: Path  # prepared data set: tokenizer.json, manifest.json, val shards
    seq_len: int  # tokens per evaluation window
    options: dict = field(repr=False)  # storage options (S3 endpoint, region; in a flow, the blocks' credentials)
    manifest: Manifest = field(repr=False)  # the checkpoint's manifest

    def store(self) -> CheckpointStore:
        return CheckpointStore.of_step(self.location, self.options)[0]

    def data_manifest(self) -> dict:
        return read_manifest(self.data_dir)


def spec_overrides(spec: CampaignSpec, data_dir: str | Path | None = None) -> dict:
    """``describe`` arguments taken from a campaign spec (model, data dir, storage options);
    ``data_dir`` replaces the spec's ``<workdir>/data`` (the vocabulary size is read from it)."""
    data_dir = Path(data_dir) if data_dir else CampaignLayout(spec.workdir_path).data_dir
    try:
        vocab = read_manifest(data_dir)["vocab_size"]
    except DataError:
        raise CheckpointInfoError(f"{data_dir} holds no prepared data set (no manifest.json): pass --data-dir with "
                                  "the campaign's prepared data") from None
    return {"model": model_config(spec, vocab), "data_dir": data_dir, "options": client_options(spec)}


def describe(location: str | Path, *, options: dict | None = None, model: ModelConfig | None = None,
             data_dir: str | Path | None = None, seq_len: int | None = None) -> CheckpointInfo:
    """Everything needed to evaluate or export the checkpoint at ``location``: its manifest's
    record, overridden by the arguments given. Raises :class:`CheckpointRejected` for a
    checkpoint that was never committed, :class:`CheckpointInfoError` when a value is missing."""
    location = str(location).rstrip("/")
    try:
        store, step = CheckpointStore.of_step(location, options)
    except ValueError as err:
        raise CheckpointInfoError(f"{err}: give the path or URL of one checkpoint, e.g. <stage>/step_00000100") from None
    try:
        manifest = store.manifest(step)
    except DamagedRecord as err:
        raise CheckpointRejected(location, [f"{store.ref(step).location}/{MANIFEST} is damaged ({err.what})"]) from None
    if manifest is None:
        raise CheckpointRejected(location, store.verify(step))
    old = "it was written before checkpoints recorded it"
    if model is None:
        if "model" not in manifest.meta:
            raise CheckpointInfoError(f"checkpoint {location} does not record its model configuration ({old}): "
                                      "pass --spec with the campaign's spec YAML (or spec= / model=)")
        try:
            model = ModelConfig(**manifest.meta["model"])
        except TypeError as err:
            raise CheckpointInfoError(f"checkpoint {location}: manifest.json has an unreadable model record ({err})") from None
    data_dir = data_dir or manifest.meta.get("data_dir")
    if not data_dir:
        raise CheckpointInfoError(f"checkpoint {location} does not record its data directory ({old}): pass --data-dir "
                                  "with the campaign's prepared data (<workdir>/data, with tokenizer.json and the val split)")
    data_dir = Path(data_dir)
    try:
        vocab = read_manifest(data_dir)["vocab_size"]
    except DataError:
        raise CheckpointInfoError(f"{data_dir} holds no prepared data set (no manifest.json): pass --data-dir with the "
                                  "data set the checkpoint was trained on (the campaign's <workdir>/data)") from None
    if vocab != model.vocab_size:
        raise CheckpointInfoError(f"the data set in {data_dir} has a vocabulary of {vocab} tokens, the checkpoint's "
                                  f"model {model.vocab_size}: pass --data-dir with the data set it was trained on")
    seq_len = seq_len or manifest.meta.get("seq_len") or model.max_seq_len
    if seq_len > model.max_seq_len:
        raise CheckpointInfoError(f"--seq-len {seq_len} exceeds the model's max_seq_len {model.max_seq_len}")
    return CheckpointInfo(location, step, model, data_dir, int(seq_len), dict(options or {}), manifest)
