"""What evaluating or exporting a checkpoint needs, read from the checkpoint itself.

Every manifest records ``JobConfig.checkpoint_meta()``: the model configuration, the data
directory (tokenizer and validation split) and the stage's sequence length. So a checkpoint
location (local directory or ``s3://…/step_XXXXXXXX``) is enough for ``pretrain eval`` and
``pretrain export``; each value can be overridden (e.g. the data directory on another machine,
or a spec for checkpoints written before manifests described themselves).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.data.campaign import validation_data
from pretrain.run.jobs import model_config
from pretrain.spec.campaign import CampaignSpec
from pretrain.state.locations import client_options
from trainer.checkpoint.records import DamagedRecord, Manifest
from trainer.checkpoint.store import MANIFEST, CheckpointStore
from trainer.data.cache import local_data_dir
from trainer.data.manifest import DataError, read_manifest
from trainer.job.config import ModelConfig


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
    ``data_dir`` replaces the data set the campaign's ledger records (the vocabulary size is read from it)."""
    try:
        if data_dir:
            data_dir = Path(data_dir)
            vocab = read_manifest(data_dir)["vocab_size"]
        else:
            data_dir, vocab = validation_data(spec)
    except DataError as err:
        raise CheckpointInfoError(
            f"{data_dir or 'the campaign'} holds no prepared data set ({err}): pass --data-dir "
            "with the campaign's prepared data"
        ) from None
    return {
        "model": model_config(spec, vocab),
        "data_dir": data_dir,
        "options": client_options(spec),
        "cache_dir": spec.layout.data_cache,
    }


def default_cache_dir() -> Path:
    """Where ``pretrain eval`` / ``export`` outside a campaign keep data sets fetched from S3."""
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "prefect-pretrain" / "data"


def _data_options(meta: dict, options: dict | None) -> dict:
    """S3 options for the checkpoint's data set: its recorded endpoint/region, the caller's credentials."""
    secrets = {k: v for k, v in (options or {}).items() if k not in ("endpoint_url", "region")}
    return {**(meta.get("data_options") or {}), **secrets}


def describe(
    location: str | Path,
    *,
    options: dict | None = None,
    model: ModelConfig | None = None,
    data_dir: str | Path | None = None,
    seq_len: int | None = None,
    cache_dir: str | Path | None = None,
) -> CheckpointInfo:
    """Everything needed to evaluate or export the checkpoint at ``location``: its manifest's
    record, overridden by the arguments given. The data set it records may be on S3: its
    tokenizer and validation split are then fetched into ``cache_dir`` (default: the user's cache,
    :func:`default_cache_dir`). Raises :class:`CheckpointRejected` for a checkpoint that was never
    committed, :class:`CheckpointInfoError` when a value is missing."""
    location = str(location).rstrip("/")
    try:
        store, step = CheckpointStore.of_step(location, options)
    except ValueError as err:
        raise CheckpointInfoError(
            f"{err}: give the path or URL of one checkpoint, e.g. <stage>/step_00000100"
        ) from None
    try:
        manifest = store.manifest(step)
    except DamagedRecord as err:
        raise CheckpointRejected(location, [f"{store.ref(step).location}/{MANIFEST} is damaged ({err.what})"]) from None
    if manifest is None:
        raise CheckpointRejected(location, store.verify(step))
    old = "it was written before checkpoints recorded it"
    if model is None:
        if "model" not in manifest.meta:
            raise CheckpointInfoError(
                f"checkpoint {location} does not record its model configuration ({old}): "
                "pass --spec with the campaign's spec YAML (or spec= / model=)"
            )
        try:
            model = ModelConfig(**manifest.meta["model"])
        except TypeError as err:
            raise CheckpointInfoError(
                f"checkpoint {location}: manifest.json has an unreadable model record ({err})"
            ) from None
    data_dir = data_dir or manifest.meta.get("data_dir")
    if not data_dir:
        raise CheckpointInfoError(
            f"checkpoint {location} does not record its data directory ({old}): pass --data-dir "
            "with the campaign's prepared data (<workdir>/data, with tokenizer.json and the val split)"
        )
    recorded = data_dir == manifest.meta.get("data_dir")
    try:
        data_dir = local_data_dir(
            str(data_dir),
            cache_dir or default_cache_dir(),
            _data_options(manifest.meta, options),
            splits=("val",),
            fingerprint=manifest.meta.get("data_fingerprint") if recorded else None,
        )
        vocab = read_manifest(data_dir)["vocab_size"]
    except DataError as err:
        raise CheckpointInfoError(
            f"{data_dir} holds no prepared data set ({err}): pass --data-dir with the data set "
            "the checkpoint was trained on"
        ) from None
    if vocab != model.vocab_size:
        raise CheckpointInfoError(
            f"the data set in {data_dir} has a vocabulary of {vocab} tokens, the checkpoint's "
            f"model {model.vocab_size}: pass --data-dir with the data set it was trained on"
        )
    seq_len = seq_len or manifest.meta.get("seq_len") or model.max_seq_len
    if seq_len > model.max_seq_len:
        raise CheckpointInfoError(f"--seq-len {seq_len} exceeds the model's max_seq_len {model.max_seq_len}")
    return CheckpointInfo(location, step, model, data_dir, int(seq_len), dict(options or {}), manifest)
