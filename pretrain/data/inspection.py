"""What a prepared data set holds, for people: stats from its manifest (documents, tokens per split,
group and source, skips, duplicates, tokenizer, fingerprint) and a few random windows decoded
with its own tokenizer, to see what training will read. Local directories and s3:// URLs."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from pretrain.console_progress import human
from trainer.data.manifest import MANIFEST, SKIP_REASONS, TOKENIZER_FILE, DamagedManifest, parse_manifest
from trainer.storage import NotFound, Storage, StorageError, open_storage

SOURCE_ROWS = 20  # sources listed one per row by default; the others are summed in one row


class InspectError(ValueError):
    """The location is not a readable data set; the message names the file and what to do."""


@dataclass
class DataSet:
    location: str
    storage: Storage
    manifest: dict

    def file_size(self, name: str) -> int | None:
        try:
            return self.storage.size(name)
        except (NotFound, FileNotFoundError):
            return None

    def read(self, name: str) -> bytes:
        try:
            return self.storage.get_bytes(name)
        except (NotFound, FileNotFoundError):
            raise InspectError(
                f"{self.where(name)} is missing: the data set is incomplete; prepare it again "
                "(`pretrain data prepare SPEC`)"
            ) from None

    def where(self, name: str) -> str:
        return f"{self.location.rstrip('/')}/{name}"

    def tokens(self, name: str, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) of shard ``name``: memory-mapped locally, one ranged read on S3."""
        dtype = np.dtype(self.manifest["dtype"])
        local = self.storage.local_path(name)
        if local is not None:
            return np.array(np.memmap(local, dtype=dtype, mode="r")[start : start + count])
        raw = self.storage.read_range(name, start * dtype.itemsize, (start + count) * dtype.itemsize)
        return np.frombuffer(raw, dtype=dtype)


def _candidates(location: str) -> list[str]:
    """Data sets one level below a local directory that is not one itself (``<workdir>/data``)."""
    path = Path(location)
    return sorted(str(p.parent) for p in path.glob(f"*/{MANIFEST}")) if path.is_dir() else []


def open_data_set(location: str, s3_options: dict | None = None) -> DataSet:
    """The data set at ``location`` (or the only one under it, e.g. ``<workdir>/data``);
    :class:`InspectError` when there is none or its manifest is damaged."""
    if not location.startswith("s3://") and not Path(location).exists():
        raise InspectError(
            f"{location} does not exist: give a prepared data set's directory (it holds {MANIFEST}) or its s3:// URL"
        )
    try:
        storage = open_storage(location, **(s3_options or {}))
        raw = storage.get_bytes(MANIFEST)
    except (NotFound, FileNotFoundError):
        inside = _candidates(location)
        if len(inside) == 1:
            return open_data_set(inside[0])
        hint = (
            f"it holds these data sets: {', '.join(inside)}; give one of them"
            if inside
            else f"give a prepared data set's directory (it holds {MANIFEST}); `pretrain data prepare SPEC` makes one"
        )
        raise InspectError(f"no data set at {location} (no {MANIFEST}): {hint}") from None
    except (StorageError, ValueError) as e:  # unreachable, refused, or options that do not fit the URL
        raise InspectError(f"cannot read {location}: {e}") from None
    try:
        manifest = parse_manifest(raw)
    except DamagedManifest as e:
        raise InspectError(
            f"{location.rstrip('/')}/{MANIFEST} is damaged ({e}): prepare the data set again "
            "(`pretrain data prepare SPEC`)"
        ) from None
    return DataSet(location, storage, manifest)


def _skips(counts) -> str:
    counts = counts if isinstance(counts, dict) else {}
    return ", ".join(f"{k} {counts[k]}" for k in SKIP_REASONS if counts.get(k)) or "none"


def render_summary(m: dict, out: Console, source_rows: int | None = SOURCE_ROWS) -> None:
    """The stats of a manifest (or the summary prepare() returns: the manifest without shards):
    its first ``source_rows`` sources one per row (None: all), the others summed in one row."""
    head = f"data set {m.get('location') or ''}".rstrip()
    out.print(
        f"{head}: fingerprint {m.get('fingerprint', '?')}, manifest v{m.get('version', 1)}"
        + (", reused" if m.get("reused") else "")
        + (f", created {m['created']}" if m.get("created") else ""),
        highlight=False,
        markup=False,
    )
    sha = m.get("tokenizer_sha256")
    out.print(
        f"tokenizer {m.get('tokenizer', 'tokenizer.json')}: vocab {m.get('vocab_size')}, {m.get('dtype')} shards, "
        f"document separator id {m.get('eot_id')}" + (f", sha256 {sha[:16]}…" if sha else ""),
        highlight=False,
        markup=False,
    )
    shards = m.get("splits")
    splits = Table("split", "documents", "tokens", *(["shards"] if shards else []), title="splits")
    for split, tokens in (m.get("tokens") or {}).items():
        splits.add_row(
            split,
            str((m.get("documents") or {}).get(split, "?")),
            f"{tokens:,}",
            *([str(len(shards.get(split, [])))] if shards else []),
        )
    out.print(splits)
    groups = m.get("groups") or {}
    if set(groups) - {"all"}:
        table = Table("group", *(f"{s} tokens" for s in m.get("tokens") or {}), title="groups")
        for g, per_split in groups.items():
            table.add_row(g, *(f"{per_split.get(s, 0):,}" for s in m.get("tokens") or {}))
        out.print(table)
    if sources := m.get("sources"):
        out.print(_sources_table(sources, source_rows, str(m.get("location") or "LOCATION")))
    if "skipped" in m:
        out.print(
            f"skipped: {_skips(m['skipped'])} (duplicates are exact repeats of an earlier document)",
            highlight=False,
            markup=False,
        )


def _sources_table(sources: list, rows: int | None, location: str) -> Table:
    """One row per source (a hand-edited manifest's odd values shown as they are), the sources
    after the first ``rows`` summed in one."""
    table = Table("format", "group", "units", "documents", "tokens", "skipped", title="sources")
    table.add_column("source", overflow="fold")  # whole paths (copy-paste), wrapped if they must
    sources = [s for s in sources if isinstance(s, dict)]
    shown, rest = (sources, []) if rows is None else (sources[:rows], sources[rows:])
    for s in shown:
        table.add_row(
            str(s.get("format", "")),
            str(s.get("group", "")),
            str(s.get("units", "")),
            _count(s.get("documents", 0)),
            _count(s.get("tokens", 0)),
            _skips(s.get("skipped")),
            str(s.get("uri")),
        )
    if rest:  # a corpus of thousands of files: their sums, not a screen per file
        total = {k: sum(v for s in rest if _is_count(v := s.get(k))) for k in ("units", "documents", "tokens")}
        skipped = Counter()
        for s in rest:
            if isinstance(s.get("skipped"), dict):
                skipped.update({k: v for k, v in s["skipped"].items() if _is_count(v)})
        table.add_row(
            "",
            "",
            *(_count(total[k]) for k in total),
            _skips(dict(skipped)),
            f"… and {len(rest):,} more sources (`pretrain data inspect {location} --all-sources` lists each)",
        )
    return table


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _count(v) -> str:
    return f"{v:,}" if _is_count(v) else str(v)


def check_shards(ds: DataSet) -> list[str]:
    """Shards the manifest lists that are missing or of the wrong size (cheap: sizes only)."""
    width = np.dtype(ds.manifest["dtype"]).itemsize
    problems = []
    for shard in (s for shards in ds.manifest["splits"].values() for s in shards):
        size, want = ds.file_size(shard["file"]), shard["tokens"] * width
        if size is None:
            problems.append(f"{ds.where(shard['file'])} is missing")
        elif size != want:
            problems.append(f"{ds.where(shard['file'])} has {size} bytes, the manifest says {want}")
    return problems


def random_windows(ds: DataSet, count: int, tokens: int, seed: int) -> list[tuple[str, int, str]]:
    """(shard, first token, decoded text) of ``count`` windows of the train split, chosen by ``seed``."""
    from tokenizers import Tokenizer

    name = ds.manifest.get("tokenizer", TOKENIZER_FILE)
    raw = ds.read(name)
    try:
        tok = Tokenizer.from_str(raw.decode())
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception type; bytes may not be UTF-8
        raise InspectError(
            f"{ds.where(name)} is damaged ({str(e)[:200]}): prepare the data set again (`pretrain data prepare SPEC`)"
        ) from None
    shards = [s for s in ds.manifest["splits"].get("train", []) if s["tokens"] > 0]
    rng, out = random.Random(seed), []
    for _ in range(count if shards else 0):
        shard = rng.choices(shards, weights=[s["tokens"] for s in shards])[0]
        start = rng.randrange(max(1, shard["tokens"] - tokens))
        ids = ds.tokens(shard["file"], start, tokens)
        out.append((shard["file"], start, tok.decode([int(i) for i in ids], skip_special_tokens=False)))
    return out


def inspect_data_set(
    location: str,
    out: Console,
    *,
    windows: int = 3,
    window_tokens: int = 64,
    seed: int = 0,
    s3_options: dict | None = None,
    source_rows: int | None = SOURCE_ROWS,
) -> None:
    """Print the stats of the data set at ``location`` and ``windows`` decoded windows; a damaged
    or incomplete data set is an :class:`InspectError` after the stats, naming its files."""
    ds = open_data_set(location, s3_options)
    render_summary({"location": ds.location, **ds.manifest}, out, source_rows)
    if problems := check_shards(ds):
        raise InspectError(
            "the data set is damaged: " + "; ".join(problems) + ": prepare it again (`pretrain data prepare SPEC`)"
        )
    for shard, start, text in random_windows(ds, windows, window_tokens, seed):
        out.print(
            f"── {shard} @ token {start:,} ({human(window_tokens)} tokens) ──",
            style="dim",
            highlight=False,
            markup=False,
        )
        out.print(text, highlight=False, markup=False)
