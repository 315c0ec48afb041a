"""The files a data spec names: each source entry (a path, glob, directory or S3 URL/prefix/glob)
expanded into :class:`SourceFile` records, with its format, compression and version identity
(size + mtime locally, the ETag on S3) so a changed file is noticed."""

from __future__ import annotations

import functools
import glob
import os
import sysconfig
from dataclasses import dataclass, field
from urllib.parse import urlparse

from pretrain.data.corpus.globs import glob_regex, has_glob, literal_prefix
from pretrain.spec.data import DataSpec, SourceSpec
from trainer.storage import Storage, StorageError, open_storage

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
COMPRESSIONS = {".gz": "gz", ".zst": "zst"}


class CorpusError(ValueError):
    """A source cannot be read as configured; the message names the spec field or file and
    what to do."""


@dataclass(frozen=True)
class SourceFile:
    """One file of the corpus, as found when the sources were expanded."""

    uri: str  # an absolute local path, or s3://bucket/key
    format: str  # "text" | "jsonl" | "parquet"
    compression: str  # "" | "gz" | "zst" (from the name's last suffix)
    text_field: str  # the JSONL field / Parquet column holding the text
    weight: float  # how often its documents appear in the train split
    group: str  # the data group it belongs to ('all' for a plain list of sources)
    size: int  # bytes as stored (compressed size for .gz/.zst)
    identity: str  # version: f"{size}:{mtime_ns}" locally, the ETag on S3
    entry: str = field(default="", compare=False)  # the spec field it came from, for messages

    @property
    def is_s3(self) -> bool:
        return self.uri.startswith("s3://")

    def bucket_key(self) -> tuple[str, str]:
        """(bucket, key) of an S3 source."""
        parsed = urlparse(self.uri)
        return parsed.netloc, parsed.path.lstrip("/")

    def describe(self) -> str:
        """How messages name it: the file, and the spec entry it came from."""
        return f"{self.uri} (from {self.entry})" if self.entry else self.uri


@functools.lru_cache(maxsize=16)
def _storage(bucket: str, options: tuple) -> Storage:
    return open_storage(f"s3://{bucket}", **dict(options))


def bucket_storage(bucket: str, s3_options: dict | None) -> Storage:
    """The storage of one bucket, kept per process: a worker reads many units, and making a
    boto3 client costs more than a ranged GET."""
    return _storage(bucket, tuple(sorted((s3_options or {}).items())))


def resolve_format(name: str, declared: str = "auto") -> tuple[str, str]:
    """(format, compression) of a file called ``name``; ``declared`` overrides 'auto'."""
    lower = name.lower()
    compression = next((c for suffix, c in COMPRESSIONS.items() if lower.endswith(suffix)), "")
    if compression:
        lower = lower.rsplit(".", 1)[0]
    if declared != "auto":
        return declared, compression
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl", compression
    return ("parquet" if lower.endswith(".parquet") else "text"), compression


def _local_matches(path: str) -> list[tuple[str, int, str]]:
    """(absolute path, size, identity) of each local file ``path`` names, sorted."""
    expanded = os.path.abspath(os.path.expanduser(path))
    if "**" in expanded:  # walk from the literal directory; '**' crosses directories
        base, regex = os.path.dirname(literal_prefix(expanded)) or "/", glob_regex(expanded)
        found = []
        for dirpath, dirs, files in os.walk(base):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            found += [p for name in files if not name.startswith(".") and regex.match(p := os.path.join(dirpath, name))]
    elif has_glob(expanded):
        found = glob.glob(expanded)
    elif os.path.isdir(expanded):  # a directory: every (non-hidden) file under it
        return _local_matches(os.path.join(glob.escape(expanded), "**"))
    else:
        found = [expanded]
    out = []
    for p in sorted(set(found)):
        try:
            st = os.stat(p)
        except OSError:
            continue
        if os.path.isfile(p):
            out.append((p, st.st_size, f"{st.st_size}:{st.st_mtime_ns}"))
    return out


def _s3_matches(url: str, s3_options: dict | None) -> list[tuple[str, int, str]]:
    """(s3 URL, size, ETag) of each object ``url`` names: one object, every object under a
    prefix, or those matching a glob (listed under the glob's literal prefix)."""
    parsed = urlparse(url)
    bucket, key = parsed.netloc, parsed.path.lstrip("/")
    storage = bucket_storage(bucket, s3_options)
    if has_glob(key):
        regex = glob_regex(key)
        objects = [o for o in storage.list_objects(literal_prefix(key)) if regex.match(o.key)]
    else:
        listed = storage.list_objects(key)
        exact = [o for o in listed if o.key == key]
        under = key.rstrip("/") + "/" if key.strip("/") else ""
        objects = exact or [o for o in listed if o.key.startswith(under)]
    return [
        (f"s3://{bucket}/{o.key}", o.size, o.etag) for o in objects if not o.key.endswith("/")
    ]  # "directory" marker objects hold no text


def _matches(spec: SourceSpec, entry: str, s3_options: dict | None) -> list[tuple[str, int, str]]:
    path = spec.path.replace("{stdlib}", sysconfig.get_paths()["stdlib"])
    try:
        found = _s3_matches(path, s3_options) if path.startswith("s3://") else _local_matches(path)
    except (StorageError, ValueError) as err:
        raise CorpusError(f"{entry} ({spec.path!r}) cannot be listed: {err}") from None
    if not found:
        shown = spec.path if path == spec.path else f"{spec.path!r} → {path}"
        raise CorpusError(f"{entry} ({shown}) matched no files: fix the path or pattern (or remove the entry)")
    return found


def expand_sources(data: DataSpec, s3_options: dict | None = None) -> dict[str, list[SourceFile]]:
    """Per data group (in spec order), its files: each entry's matches sorted, in entry order,
    a file named twice kept once (first entry wins), at most ``data.max_bytes`` per group
    (whole files, in order). Raises :class:`CorpusError` naming the entry when one matches
    nothing or cannot be listed (missing bucket, bad credentials, endpoint down)."""
    out: dict[str, list[SourceFile]] = {}
    listed = isinstance(data.sources, list)
    for group, specs in data.groups().items():
        where = "data.sources" if listed else f"data.sources.{group}"
        chosen: list[SourceFile] = []
        seen: set[str] = set()
        total = 0
        for i, spec in enumerate(specs):
            entry = f"{where}[{i}]"
            for uri, size, identity in _matches(spec, entry, s3_options):
                if uri in seen or (data.max_bytes is not None and total >= data.max_bytes):
                    continue
                fmt, compression = resolve_format(uri, spec.format)
                if fmt == "parquet" and compression:
                    raise CorpusError(
                        f"{entry}: {uri} is a compressed Parquet file; Parquet compresses "
                        "its columns itself: store it uncompressed (or fix data.sources)"
                    )
                seen.add(uri)
                total += size
                chosen.append(
                    SourceFile(uri, fmt, compression, spec.text_field, spec.weight, group, size, identity, entry)
                )
        out[group] = chosen
    return out
