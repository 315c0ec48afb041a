"""Shared-memory snapshot slots: one file per (local rank, slot) in a job's shm directory.

A slot is ``[header 4 KiB][layout JSON][tensor bytes]``, mapped into the worker (writer) and
the node's saver (reader). Coordination is by ``flock`` on the slot file: the writer holds it
exclusively while copying, readers (saver, digest thread, restore) hold it shared; the kernel
drops a dead process's locks, so a SIGKILL never leaves a slot locked.

Header states: ``writing`` (torn, never read) → ``ready`` (complete) → ``ready`` + ``digest``
(xxh3-128 of layout+data, verified before anyone restores or persists it).
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import xxhash

from trainer.checkpoint.flat import Layout, copy_into, read_state, views
from trainer.checkpoint.sizing import HEADER_BYTES, PAGE

MAGIC = b"PTSNAP01"


class ShmTooSmall(RuntimeError):
    """Shared memory cannot hold the snapshots; the message says how much is needed."""


def _page_align(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def too_small(shm_dir: str | Path, free: int, need: int, detail: str = "") -> ShmTooSmall:
    return ShmTooSmall(
        f"{shm_dir} has {free / 2**20:.0f} MiB free but the checkpoint snapshots need {need / 2**20:.0f} MiB{detail}: "
        f"give the node more shared memory (docker --shm-size, Kubernetes emptyDir medium: Memory) or set "
        f"checkpoint.shm_fallback: true to persist checkpoints directly without snapshots"
    )


def check_capacity(shm_dir: str | Path, need: int, detail: str = "") -> None:
    free = shutil.disk_usage(shm_dir).free
    if free < need:
        raise too_small(shm_dir, free, need, detail)


def _parse_header(raw: bytes) -> dict | None:
    if len(raw) < HEADER_BYTES or raw[:8] != MAGIC:
        return None
    n = int.from_bytes(raw[8:12], "little")
    try:
        return json.loads(raw[12 : 12 + n])
    except (ValueError, UnicodeDecodeError):  # torn header: treat as absent this round
        return None


def read_header(path: str | Path) -> dict | None:
    """The header of the slot file at ``path``, for a reader that maps nothing (the saver picking
    what to persist, the agent waiting for copies): None if the file is missing, empty or its
    header torn. Never creates the file (``Slot`` would)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return _parse_header(os.pread(fd, HEADER_BYTES, 0))
    finally:
        os.close(fd)


class Slot:
    def __init__(self, path: str | Path, capacity: int = 0):
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self.mm: mmap.mmap | None = None
        self._written: tuple[Layout, int, list] | None = None  # the last write's layout, data offset, views
        self._map()
        if capacity > self.size:
            self.grow(capacity)

    @property
    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def _map(self) -> None:
        self._written = None  # its views hold the old mapping
        if self.mm is not None:
            self.mm.close()
        self.mm = mmap.mmap(self.fd, self.size) if self.size else None

    def grow(self, capacity: int) -> None:
        """Allocate and touch every page now, so the first copy does not pay page faults."""
        capacity, before = _page_align(HEADER_BYTES + capacity), self.size
        try:
            os.posix_fallocate(self.fd, 0, capacity)
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
            os.ftruncate(self.fd, before)  # give back what a partial allocation took
            raise too_small(
                self.path.parent,
                shutil.disk_usage(self.path.parent).free,
                capacity - before,
                f" more (snapshot slot {self.path.name})",
            ) from None
        self._map()
        np.frombuffer(self.mm, dtype=np.uint8)[::PAGE] = 0

    def close(self) -> None:
        self._written = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # views are still alive (e.g. held by an exception's traceback):
                pass  # the mapping goes with the last of them; never mask the error being raised
        os.close(self.fd)

    # ---- header ------------------------------------------------------------------------
    def header(self) -> dict | None:
        if self.mm is None or self.size < HEADER_BYTES:
            return None
        return _parse_header(self.mm[:HEADER_BYTES])

    def set_header(self, h: dict) -> None:
        body = json.dumps(h).encode()
        self.mm[12 : 12 + len(body)] = body
        self.mm[8:12] = len(body).to_bytes(4, "little")
        self.mm[:8] = MAGIC

    # ---- locking -----------------------------------------------------------------------
    @contextmanager
    def lock(self, exclusive: bool, blocking: bool = True):
        """Yields True when held; with ``blocking=False`` yields False if someone else holds it."""
        fd = os.open(self.path, os.O_RDONLY)  # own open file description: conflicts with other fds
        try:
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # releases the lock

    # ---- content -----------------------------------------------------------------------
    def write(self, state, header: dict) -> None:
        """Copy ``state`` in (caller holds the exclusive lock). Grows the slot if needed. A state
        laid out as the last one written (every snapshot of a run) is copied into the same views."""
        layout, tensors = Layout.of(state, like=self._written[0] if self._written else None)
        meta = layout.to_json()
        data_off = _page_align(HEADER_BYTES + len(meta))
        if data_off + layout.data_bytes > self.size:
            self.grow(data_off + layout.data_bytes)
        if not (self._written and self._written[0].entries is layout.entries and self._written[1] == data_off):
            self._written = (
                layout,
                data_off,
                views(memoryview(self.mm)[data_off : data_off + layout.data_bytes], layout),
            )
        self.set_header({**header, "state": "writing"})
        self.mm[HEADER_BYTES : HEADER_BYTES + len(meta)] = meta
        copy_into(self._written[2], tensors)
        self.set_header(
            {
                **header,
                "state": "ready",
                "meta_len": len(meta),
                "data_off": data_off,
                "data_len": layout.data_bytes,
                "digest": None,
            }
        )

    def compute_digest(self, h: dict) -> str:
        """xxh3-128 of layout + data: a corruption check at memory speed (~0.05 s/GiB), where
        sha256 would cost ~0.6 s/GiB on the restore path. Storage shards use sha256."""
        d = xxhash.xxh3_128()
        view = memoryview(self.mm)
        d.update(view[HEADER_BYTES : HEADER_BYTES + h["meta_len"]])
        step = 64 << 20
        for off in range(h["data_off"], h["data_off"] + h["data_len"], step):
            d.update(view[off : min(off + step, h["data_off"] + h["data_len"])])
        return d.hexdigest()

    def sealed(self) -> dict | None:
        """The header if the slot holds a complete snapshot with its digest (not yet checked)."""
        h = self.header()
        return h if h and h.get("state") == "ready" and h.get("digest") else None

    def verified(self) -> dict | None:
        """The header if the slot holds a complete snapshot whose digest matches."""
        h = self.sealed()
        return h if h and self.compute_digest(h) == h["digest"] else None

    def read(self, h: dict, clone: bool = True):
        layout = Layout.from_json(bytes(self.mm[HEADER_BYTES : HEADER_BYTES + h["meta_len"]]))
        return read_state(memoryview(self.mm)[h["data_off"] : h["data_off"] + h["data_len"]], layout, clone=clone)


def slot_paths(ns: str | Path, local_rank: int) -> list[Path]:
    return [Path(ns) / f"rank{local_rank:03d}.slot{j}" for j in (0, 1)]
