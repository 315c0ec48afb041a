"""A data set's fingerprint: what its bytes depend on, hashed. Same inputs → same directory
(reused, never rewritten); any changed input → a new directory."""

from __future__ import annotations

import hashlib
import json

from pretrain.spec.data import DataSpec

FORMAT_VERSION = 2  # bump when the pipeline's output for the same inputs changes


def output_settings(data: DataSpec) -> dict:
    """The data settings that change the data set's bytes (``workers`` does not; ``unit_bytes``
    does: a text file bigger than a unit is split into documents at unit boundaries)."""
    return {
        "format_version": FORMAT_VERSION,
        "val_fraction": data.val_fraction,
        "shard_tokens": data.shard_tokens,
        "unit_bytes": data.unit_bytes,
        "decode_errors": data.decode_errors,
        "binary_threshold": data.binary_threshold,
        "on_bad_record": data.on_bad_record,
        "max_bytes": data.max_bytes,
    }


def tokenizer_identity(data: DataSpec, given_sha256: str | None) -> dict:
    """A given tokenizer is its file's sha256 (not its path); a trained one is its settings (its
    sample follows from the sources, which the fingerprint covers already)."""
    t = data.tokenizer
    if given_sha256 is not None:
        return {"sha256": given_sha256, "eos_token": t.eos_token}
    return {
        "trained": {
            "vocab_size": t.vocab_size,
            "min_frequency": t.min_frequency,
            "sample_bytes": t.sample_bytes,
            "eos_token": t.eos_token,
        }
    }


def source_entry(source) -> dict:
    """One source file as the fingerprint and the manifest see it."""
    return {
        "uri": source.uri,
        "format": source.format,
        "compression": source.compression,
        "text_field": source.text_field,
        "weight": source.weight,
        "group": source.group,
        "size": source.size,
        "identity": source.identity,
    }


def fingerprint(sources: dict[str, list], settings: dict, tokenizer: dict) -> str:
    body = {
        "sources": [source_entry(s) for group in sources.values() for s in group],
        "groups": list(sources),
        "settings": settings,
        "tokenizer": tokenizer,
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
