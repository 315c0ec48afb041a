"""The small JSON records of a checkpoint location, their schemas in one place.

Any of these files may be truncated, overwritten by hand or left by another version: each
``parse_*`` function returns the typed record or raises :class:`DamagedRecord` naming the key
and what is wrong with it, never a bare ``JSONDecodeError``/``KeyError``. Each record also has
exactly one encoder here, so every writer produces the same shape (what the parsers accept).

========================  ===================================  =================================
record                    written by                           a damaged one means
========================  ===================================  =================================
``latest``, ``good``      ``encode_pointer``                   ``latest``: derive it from the
                                                               manifests; ``good``: ignore it
``step_*/manifest.json``  ``encode_manifest``                  the checkpoint is bad
``step_*/node_*.json``    ``encode_node_record``               the checkpoint is bad
``step_*/verdict.json``   ``CheckpointStore.set_verdict``      the checkpoint is unjudged again
========================  ===================================  =================================
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_SHARD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # a file directly inside its step directory
_DIR_NAME = re.compile(r"^step_\d{8}$")
VERDICTS = ("good", "bad")


class DamagedRecord(ValueError):
    """A checkpoint record that cannot be read: not JSON, or not the shape its schema says."""

    def __init__(self, key: str, what: str):
        self.key, self.what = key, what
        super().__init__(f"{key} is damaged ({what})")


def load_object(key: str, data: bytes) -> dict:
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, ValueError) as err:
        raise DamagedRecord(key, f"not valid JSON: {err}") from None
    if not isinstance(obj, dict):
        raise DamagedRecord(key, f"a JSON {type(obj).__name__}, not an object")
    return obj


def encode_object(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def _int(key: str, obj: dict, name: str, minimum: int = 0) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DamagedRecord(key, f"{name!r} is {value!r}, not an integer >= {minimum}")
    return value


def shard_name(key: str, name: object) -> str:
    """``name`` if it names a file inside the step directory (no ``/``, ``..``, absolute path)."""
    if not isinstance(name, str) or not _SHARD_NAME.match(name):
        raise DamagedRecord(key, f"shard name {name!r} is not a plain file name inside the step directory")
    return name


# ---- pointers: latest, good ---------------------------------------------------------------------
@dataclass(frozen=True)
class Pointer:
    step: int
    dir: str  # step_XXXXXXXX, the step directory it points to


def encode_pointer(step: int) -> bytes:
    return encode_object({"step": step, "dir": f"step_{step:08d}"})


def parse_pointer(key: str, data: bytes) -> Pointer:
    obj = load_object(key, data)
    step = _int(key, obj, "step")
    directory = obj.get("dir", f"step_{step:08d}")
    if directory != f"step_{step:08d}" or not _DIR_NAME.match(str(directory)):
        raise DamagedRecord(key, f"'dir' {directory!r} does not match step {step}")
    return Pointer(step, directory)


# ---- manifest --------------------------------------------------------------------------------
@dataclass(frozen=True)
class FileEntry:
    sha256: str  # hex digest of the shard's bytes
    bytes: int  # its size


@dataclass(frozen=True)
class Manifest:
    step: int
    files: dict[str, FileEntry]  # shard name → digest and size
    world_size: int = 1  # ranks that wrote the checkpoint
    meta: dict = field(default_factory=dict)  # the rest: model, data_dir, seq_len, stage, parallelism, created…


def encode_manifest(step: int, shards: list[dict], meta: dict) -> bytes:
    """The manifest of ``shards`` (``write_shard`` entries) with the job's ``meta`` record."""
    files = {s["name"]: {"sha256": s["sha256"], "bytes": s["bytes"]} for s in shards}
    return encode_object({**meta, "step": step, "files": files})


def _file_entry(key: str, name: str, entry: object) -> FileEntry:
    if not isinstance(entry, dict):
        raise DamagedRecord(key, f"the entry of {name!r} is {entry!r}, not an object")
    digest = entry.get("sha256")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise DamagedRecord(key, f"the entry of {name!r} has no sha256 hex digest")
    return FileEntry(digest, _int(key, entry, "bytes"))


def parse_manifest(key: str, data: bytes, step: int | None = None) -> Manifest:
    """The manifest in ``data``; ``step``: the step of the directory it was read from."""
    obj = load_object(key, data)
    got = _int(key, obj, "step")
    if step is not None and got != step:
        raise DamagedRecord(key, f"it says step {got}, but lies in the directory of step {step}")
    files = obj.get("files")
    if not isinstance(files, dict) or not files:
        raise DamagedRecord(
            key,
            f"'files' is {type(files).__name__ if files is not None else 'missing'}, not an object naming the shards",
        )
    parsed = {shard_name(key, n): _file_entry(key, n, e) for n, e in files.items()}
    world = _int(key, obj, "world_size", 1) if "world_size" in obj else 1
    meta = {k: v for k, v in obj.items() if k not in ("step", "files", "world_size")}
    for name, kind in (("model", dict), ("data_dir", str), ("seq_len", int), ("stage", str)):
        if name in meta and (not isinstance(meta[name], kind) or isinstance(meta[name], bool)):
            raise DamagedRecord(key, f"{name!r} is {meta[name]!r}, not a {kind.__name__}")
    return Manifest(got, parsed, world, meta)


# ---- node records ----------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeRecord:
    world_size: int
    shards: list[dict]  # write_shard entries: {"name", "sha256", "bytes"}


def encode_node_record(world_size: int, shards: list[dict]) -> bytes:
    return encode_object({"world_size": world_size, "shards": shards})


def parse_node_record(key: str, data: bytes) -> NodeRecord:
    obj = load_object(key, data)
    shards = obj.get("shards")
    if not isinstance(shards, list):
        raise DamagedRecord(key, "'shards' is not a list")
    for s in shards:
        if not isinstance(s, dict):
            raise DamagedRecord(key, f"a shard entry is {s!r}, not an object")
        _file_entry(key, shard_name(key, s.get("name")), s)
    return NodeRecord(_int(key, obj, "world_size", 1), shards)


# ---- verdicts --------------------------------------------------------------------------------
def parse_verdict(key: str, data: bytes) -> dict:
    """The gate's verdict record (kept as the dict it is, since it travels as-is to the ledger,
    events and MLflow): ``verdict`` is "good" or "bad", ``problems`` a list of strings."""
    obj = load_object(key, data)
    if obj.get("verdict") not in VERDICTS:
        raise DamagedRecord(key, f"'verdict' is {obj.get('verdict')!r}, not one of {VERDICTS}")
    problems = obj.get("problems", [])
    if not isinstance(problems, list) or not all(isinstance(p, str) for p in problems):
        raise DamagedRecord(key, "'problems' is not a list of strings")
    return obj


def encode_verdict(record: dict) -> bytes:
    return encode_object(record)
