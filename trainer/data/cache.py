"""Training reads from anywhere: a data set on S3 is fetched into a node-local cache.

Workers memory-map shards, so they need them on a local disk. ``local_data_dir`` returns a
local data set as it is; for an ``s3://`` one it fetches the manifest, the tokenizer and the
shards it is asked for into ``<cache_root>/<fingerprint>/``, each checked against the sha256
the manifest records and put in place atomically (temporary file, fsync, rename), so a killed
fetch never leaves a file that looks whole. A data set's directory is immutable, so the cache is
reused across restarts, attempts and stages; a cached file that no longer matches its digest is
fetched again, and while S3 cannot be reached a complete, verified cached copy is used as it is.
The local ranks of a node take turns (a lock per data set): the first fetches and verifies, the
others find the files verified in the same ``session`` and only compare their size and mtime.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from trainer.common.atomic import atomic_write_bytes, atomic_write_json, fsync_dir, sha256_file
from trainer.common.diskfull import describe, is_disk_full
from trainer.data.manifest import MANIFEST, DataError, load_manifest, read_manifest
from trainer.storage import NotFound, Storage, StorageError, check_key, open_storage

VERIFIED = ".verified.json"  # {"session", "manifest": sha256, "files": {name: [size, mtime_ns]}}
LOCK_POLL_S = 0.2

Progress = Callable[[], None]


def is_remote(location: str | Path) -> bool:
    """An object-store URL (``s3://…``), not a local directory."""
    text = os.fspath(location)
    return "://" in text and not text.startswith("file://")


def local_data_dir(
    location: str | Path,
    cache_root: str | Path,
    s3_options: dict | None = None,
    *,
    splits: Iterable[str] | None = None,
    fingerprint: str | None = None,
    session: str = "",
    on_progress: Progress | None = None,
) -> Path:
    """A local directory holding the data set at ``location`` (a local directory, returned as is,
    or an ``s3://`` URL, fetched into the cache). ``splits``: only the shards of these splits
    (None: all); ``fingerprint``: the data set the caller was built for (another one is a
    :class:`DataError`); ``session``: callers sharing it (the ranks of one job launch) trust each
    other's verification; ``on_progress`` is called while waiting and per file (heartbeats)."""
    beat = on_progress or (lambda: None)
    if not is_remote(location):
        local = Path(os.fspath(location).removeprefix("file://"))
        if fingerprint:
            _check_fingerprint(read_manifest(local), fingerprint, str(local))
        return local
    location = os.fspath(location).rstrip("/")
    try:
        storage, raw, manifest = fetch_manifest(location, s3_options)
    except StorageError:  # S3 away: a complete cached copy of the data set asked for still trains
        cached = _complete_copy(Path(cache_root), fingerprint, splits)
        if cached is None:
            raise
        return cached
    if fingerprint:
        _check_fingerprint(manifest, fingerprint, location)
    digest = hashlib.sha256(raw).hexdigest()
    target = Path(cache_root) / check_key(str(manifest.get("fingerprint") or digest[:16]))
    wanted = _files(manifest, splits)
    try:
        with _locked(target, beat):
            for stale in target.glob(".*.part-*"):  # a fetcher killed mid-file (we hold the lock)
                stale.unlink(missing_ok=True)
            verified = _verified(target, session, digest)
            for name, sha256 in wanted:
                _ensure(storage, target, name, sha256, trusted=verified.get(name))
                verified[name] = _stat(target / name)
                beat()
            if session:
                atomic_write_json(target / VERIFIED, {"session": session, "manifest": digest, "files": verified})
            if not (target / MANIFEST).is_file() or (target / MANIFEST).read_bytes() != raw:
                atomic_write_bytes(target / MANIFEST, raw)  # last
    except OSError as err:
        if not is_disk_full(err):
            raise
        need = sum(int(s.get("tokens", 0)) for split in manifest["splits"].values() for s in split) * 4
        raise DataError(
            describe(
                target,
                need,
                f"the data set {location}",
                "Free space there, or point the node cache at a larger disk; the cache never "
                "uses a partly fetched file.",
            )
        ) from None
    return target


def fetch_manifest(location: str, s3_options: dict | None = None) -> tuple[Storage, bytes, dict]:
    """The storage of the data set at ``location`` (local or S3), its manifest's bytes and content."""
    storage = open_storage(location, **((s3_options or {}) if is_remote(location) else {}))
    try:
        raw = storage.get_bytes(MANIFEST)
    except NotFound:
        raise DataError(
            f"no data set at {location} (no {MANIFEST}): prepare it first (`pretrain run` or "
            "`pretrain data prepare` does), or fix data.uri"
        ) from None
    return storage, raw, load_manifest(raw, f"{location}/{MANIFEST}")


def _complete_copy(cache_root: Path, fingerprint: str | None, splits: Iterable[str] | None) -> Path | None:
    """The cached data set ``fingerprint`` if every file of ``splits`` is there and matches its
    digest (None otherwise, or when the caller did not say which data set it wants)."""
    if not fingerprint:
        return None
    target = cache_root / check_key(fingerprint)
    try:
        manifest = read_manifest(target)
        with _locked(target, lambda: None):
            ok = manifest.get("fingerprint") == fingerprint and all(
                (target / name).is_file() and (sha256 is None or sha256_file(target / name) == sha256)
                for name, sha256 in _files(manifest, splits)
            )
    except (DataError, OSError, ValueError):
        return None
    return target if ok else None


def _check_fingerprint(manifest: dict, fingerprint: str, where: str) -> None:
    if manifest.get("fingerprint") != fingerprint:
        raise DataError(
            f"the data set at {where} has fingerprint {manifest.get('fingerprint')}, but this job was "
            f"built for data set {fingerprint}: run the campaign again so it prepares and records the "
            "data set it trains on"
        )


def _files(manifest: dict, splits: Iterable[str] | None) -> list[tuple[str, str | None]]:
    """(name, sha256) of the tokenizer and the shards of ``splits``, names checked to stay inside."""
    names = [(manifest.get("tokenizer", "tokenizer.json"), manifest.get("tokenizer_sha256"))]
    chosen = manifest["splits"] if splits is None else {s: manifest["splits"].get(s, []) for s in splits}
    names += [(shard["file"], shard.get("sha256")) for shards in chosen.values() for shard in shards]
    for name, _ in names:
        check_key(name)
    return names


def _stat(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _verified(target: Path, session: str, digest: str) -> dict[str, list[int]]:
    """Files another caller of the same ``session`` verified for this manifest (name → stat then)."""
    if not session:
        return {}
    try:
        record = json.loads((target / VERIFIED).read_bytes())
        if record.get("session") == session and record.get("manifest") == digest:
            return {k: list(v) for k, v in record["files"].items()}
    except (OSError, ValueError, KeyError, AttributeError, TypeError):  # absent or damaged: verify again
        pass
    return {}


def _ensure(storage: Storage, target: Path, name: str, sha256: str | None, trusted: list[int] | None) -> None:
    """``target/name`` present and matching ``sha256``: kept if it does, fetched if not."""
    path = target.joinpath(*name.split("/"))
    if path.is_file():
        if trusted is not None and _stat(path) == trusted:
            return
        if sha256 is None or sha256_file(path) == sha256:
            return
        path.unlink()  # damaged: never read again, even if the fetch below fails
    for _ in range(2):  # a download damaged on the way is fetched once more
        got = _fetch(storage, name, path, sha256)
        if got is None:
            return
    raise DataError(
        f"{storage.url}/{name} does not match the sha256 its manifest records (got {got}, expected "
        f"{sha256}): the data set there is damaged; delete it and run data preparation again"
    )


def _fetch(storage: Storage, name: str, path: Path, sha256: str | None) -> str | None:
    """Stream ``name`` into ``path`` atomically if it matches ``sha256`` (None: any content); returns
    None when it was put in place, else the digest of what came (nothing is left behind)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as f:
            for block in storage.iter_bytes(name):
                h.update(block)
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        if sha256 is not None and h.hexdigest() != sha256:
            return h.hexdigest()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return None


@contextmanager
def _locked(target: Path, beat: Progress) -> Iterator[None]:
    """One fetcher per data set and node at a time; waiting callers keep beating."""
    target.mkdir(parents=True, exist_ok=True)
    fd = os.open(target.parent / f".{target.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                beat()
                time.sleep(LOCK_POLL_S)  # another rank of this node is fetching
        yield
    finally:
        os.close(fd)  # releases the lock


def job_data(job, splits: tuple[str, ...] = ("train",), on_progress=None) -> Path:
    """The local directory of a job's data set (``job``: a ``trainer.job.config.JobConfig``): its
    ``splits`` fetched into the node cache when it is on S3; the ranks of one launch verify the
    cache once."""
    return local_data_dir(
        job.data.uri,
        job.data.cache_dir,
        job.data.options,
        splits=splits,
        fingerprint=job.data.fingerprint or None,
        session=job.job_dir,
        on_progress=on_progress,
    )
