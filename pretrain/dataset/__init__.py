"""Data preparation at scale: sources (pretrain.corpus) → tokenizer → token shards in a versioned,
immutable data set (``<root>/<fingerprint>/``) with its manifest written last.

``from pretrain.dataset import prepare, DataPrepError`` works; both load on first use, so pool
workers, which import modules of this package, do not import the whole pipeline."""

from __future__ import annotations

__all__ = ["DataPrepError", "PrepProgress", "prepare"]


def __getattr__(name: str):
    if name == "prepare":
        from pretrain.dataset.prepare import prepare

        return prepare
    if name == "DataPrepError":
        from pretrain.dataset.errors import DataPrepError

        return DataPrepError
    if name == "PrepProgress":
        from pretrain.dataset.progress import PrepProgress

        return PrepProgress
    raise AttributeError(f"module 'pretrain.dataset' has no attribute {name!r}")
