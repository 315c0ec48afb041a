"""The data set's manifest (``manifest.json``), its schema in one place: one encoder (version 2,
written by data preparation) and one parser (versions 1 and 2, read by training, evaluation,
the node cache and the next preparation).

A data set directory holds ``tokenizer.json``, the token shards and this manifest, written
last: a directory without a readable manifest is not a data set. Version 2 adds the
fingerprint's inputs (per-source identities, counts and skips, the settings, the tokenizer's
sha256) to version 1 (splits, dtype, vocab_size, eot_id, tokens, documents, groups)::

    {"version": 2, "fingerprint": str, "dtype": "uint16"|"uint32", "vocab_size": int, "eot_id": int,
     "tokenizer": "tokenizer.json", "tokenizer_sha256": str,
     "splits": {split: [{"file", "tokens", "sha256", "group"}]}, "documents": {split: int},
     "tokens": {split: int}, "groups": {group: {split: tokens}},
     "sources": [{"uri", "format", "group", "identity", "size", "units", "documents", "tokens",
                  "skipped": {reason: int}}],
     "skipped": {reason: int}, "settings": {...}}

No timestamp: the same inputs give a byte-identical manifest (the file's mtime says when).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
VERSION = 2
DTYPES = ("uint16", "uint32")
SKIP_REASONS = ("binary", "decode", "bad_record", "empty", "duplicate")
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # a file directly inside the data set directory


class DamagedManifest(ValueError):
    """Not a data manifest this code can read; the message says what is wrong with it."""


def _fail(what: str):
    raise DamagedManifest(what)


def parse_manifest(raw: bytes) -> dict:
    """The manifest in ``raw`` (version 1 or 2), checked enough that readers can trust its shape."""
    try:
        m = json.loads(raw)
    except ValueError as err:  # not JSON, not UTF-8, truncated
        raise DamagedManifest(str(err)) from None
    if not (isinstance(m, dict) and isinstance(m.get("splits"), dict) and all(k in m for k in ("dtype", "vocab_size"))):
        _fail("not a data manifest: no splits/dtype/vocab_size")
    version = m.get("version", 1)
    if version not in (1, VERSION):
        _fail(f"version {version!r}: this release reads versions 1 and {VERSION}; prepare the data set again")
    if m["dtype"] not in DTYPES:
        _fail(f"dtype {m['dtype']!r} is not one of {DTYPES}")
    for split, shards in m["splits"].items():
        if not isinstance(shards, list):
            _fail(f"splits.{split} is not a list of shards")
        for s in shards:
            if not (
                isinstance(s, dict)
                and isinstance(s.get("file"), str)
                and _FILE_NAME.match(s["file"])
                and isinstance(s.get("tokens"), int)
                and s["tokens"] >= 0
            ):
                _fail(f"splits.{split} has a bad shard entry {s!r}")
    if version == VERSION:
        for key, kind in (("fingerprint", str), ("tokenizer_sha256", str), ("sources", list), ("settings", dict)):
            if not isinstance(m.get(key), kind):
                _fail(f"{key!r} is {m.get(key)!r}, not a {kind.__name__}")
        if any(not isinstance(s.get("sha256"), str) for shards in m["splits"].values() for s in shards):
            _fail("a shard has no sha256")
    return m


def encode_manifest(
    *,
    fingerprint: str,
    dtype: str,
    vocab_size: int,
    eot_id: int,
    tokenizer_sha256: str,
    splits: dict[str, list[dict]],
    documents: dict[str, int],
    groups: list[str],
    sources: list[dict],
    settings: dict,
) -> bytes:
    """The version-2 manifest; totals are derived here so they always agree with the shards."""
    skipped = {r: sum(s["skipped"].get(r, 0) for s in sources) for r in SKIP_REASONS}
    manifest = {
        "version": VERSION,
        "fingerprint": fingerprint,
        "dtype": dtype,
        "vocab_size": vocab_size,
        "eot_id": eot_id,
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_sha256": tokenizer_sha256,
        "splits": splits,
        "documents": documents,
        "tokens": {k: sum(s["tokens"] for s in v) for k, v in splits.items()},
        "groups": {g: {k: sum(s["tokens"] for s in v if s["group"] == g) for k, v in splits.items()} for g in groups},
        "sources": sources,
        "skipped": skipped,
        "settings": settings,
    }
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


class DataError(RuntimeError):
    """The prepared data set is missing or unusable; the message names the file."""


def read_manifest(data_dir: str | Path) -> dict:
    """The data set's manifest (version 1 or 2); a missing or damaged one is a :class:`DataError`
    saying what to do."""
    path = Path(data_dir) / MANIFEST
    try:
        raw = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        raise DataError(f"no data manifest at {path}: run data preparation first (`pretrain run` does)") from None
    except IsADirectoryError:
        raise DataError(
            f"{path} is damaged (a directory, not a file): run data preparation again (`pretrain run` redoes it)"
        ) from None
    except OSError as err:  # no permission, an I/O error
        raise DataError(f"cannot read the data manifest {path} ({err.strerror or err})") from None
    return load_manifest(raw, str(path))


def load_manifest(raw: bytes, where: str) -> dict:
    """The manifest in ``raw``, read from ``where`` (a path or URL); a damaged one is a :class:`DataError`."""
    try:
        return parse_manifest(raw)
    except DamagedManifest as e:
        raise DataError(f"{where} is damaged ({e}): run data preparation again (`pretrain run` redoes it)") from None
