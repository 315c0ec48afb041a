"""Corpus files of every format for the corpus-reading tests (plain, compressed, JSONL, Parquet) and reading
them back."""

from __future__ import annotations

import json
from pathlib import Path

from pretrain.data.corpus import Doc, Skip, expand_sources, plan_units, read_unit
from pretrain.spec.data import DataSpec


def spec(sources, **kw) -> DataSpec:
    return DataSpec(sources=sources, **kw)


def read_all(data: DataSpec, unit_bytes: int | None = None, s3_options: dict | None = None) -> list[Doc | Skip]:
    """Every document and skip of the corpus, in source order, through units of ``unit_bytes``."""
    out = []
    if unit_bytes:  # below the spec's minimum, to cut small test files into many units
        data = data.model_copy(update={"unit_bytes": unit_bytes})
    for files in expand_sources(data, s3_options).values():
        for source in files:
            for unit in plan_units(source, data.unit_bytes, s3_options):
                out.extend(read_unit(unit, data, s3_options))
    return out


def texts(items) -> list[str]:
    return [x.text for x in items if isinstance(x, Doc)]


def skips(items) -> list[tuple[str, str]]:
    return [(x.reason, x.where) for x in items if isinstance(x, Skip)]


def write_jsonl(path: Path, records, field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: r} if isinstance(r, str) else r) + "\n" for r in records))
    return path


def compress(path: Path, kind: str) -> Path:
    import gzip

    import zstandard

    out = path.with_name(path.name + "." + kind)
    raw = path.read_bytes()
    out.write_bytes(gzip.compress(raw) if kind == "gz" else zstandard.ZstdCompressor().compress(raw))
    return out


def write_parquet(path: Path, values, row_group_size: int = 3, column: str = "text", **extra) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: values, **extra}), path, row_group_size=row_group_size)
    return path
