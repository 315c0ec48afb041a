"""Flash checkpoints, worker side: a blocking copy into shared memory, nothing more.

Each local rank owns two slots and alternates between them, so a complete snapshot always
remains while the next one is copied. After the copy a background thread computes
the slot's xxh3-128 digest (off the training path; the shards in storage carry sha256). The
node's saver (``trainer.saver``) persists snapshots flagged ``persist`` and commits them; the
worker never writes storage itself.

Policy when the older slot is busy (the saver is persisting it, or a peer reads it): the
snapshot goes into the newest slot instead, since the busy one is a complete snapshot its
reader holds — so memory snapshots stay fresh while a slow persist runs, instead of aging by
one interval per snapshot skipped — unless the newest slot is busy too or holds a snapshot
flagged for persisting and this one is not (the saver may not have taken it yet). Then it is
**skipped** (reported as such), never waited for and never allowed to tear a snapshot.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from trainer.checkpoint.shm import Slot, check_capacity, read_header, slot_paths

DIGEST_THREAD = "snapshot-digest"  # the thread that seals a snapshot after its copy


def node_missing(ns: Path, capacities: dict[int, int]) -> int:
    """Bytes still to allocate for the slots of every local rank (local rank → bytes per slot)."""
    return sum(
        max(0, cap - (p.stat().st_size if p.exists() else 0))
        for lr, cap in capacities.items()
        for p in slot_paths(ns, lr)
    )


def finish_digests(timeout_s: float) -> None:
    """Let this process's snapshot digests still running finish (at most ``timeout_s``): a worker
    leaving on an error (a peer died under a collective) seals the snapshot it has copied, so the
    restart can use it rather than the one before."""
    deadline = time.monotonic() + timeout_s
    for t in threading.enumerate():
        if t.name == DIGEST_THREAD:
            t.join(max(0.0, deadline - time.monotonic()))


def copies_in_flight(ns: str | Path, pids: set[int]) -> list[str]:
    """The slots under ``ns`` that a process of ``pids`` is copying a snapshot into or sealing
    (``writing``, or ``ready`` without its digest yet); a slot left so by a dead process is not."""
    return [
        path.name
        for path in sorted(Path(ns).glob("rank*.slot*"))
        if (h := read_header(path)) and h.get("pid") in pids and (h.get("state") == "writing" or not h.get("digest"))
    ]


class SnapshotStore:
    def __init__(
        self,
        ns: str | Path,
        local_rank: int,
        rank: int,
        world_size: int,
        capacity: int,
        node: dict[int, int] | None = None,
    ):
        """``node``: bytes per slot of every local rank on this node (default: this rank alone).
        The check counts them all, so the node's ranks together cannot overcommit shared memory."""
        self.ns = Path(ns)
        self.rank, self.world_size = rank, world_size
        self.ns.mkdir(parents=True, exist_ok=True)
        node = {**(node or {}), local_rank: capacity}
        check_capacity(
            self.ns, node_missing(self.ns, node), f" more (2 slots for each of the node's {len(node)} local rank(s))"
        )
        self.slots = [Slot(p, capacity) for p in slot_paths(self.ns, local_rank)]
        self._digests: list[threading.Thread] = []  # sealing snapshots (two may overlap: one per slot)

    def _newest(self) -> int | None:
        steps = [(h["step"], i) for i, s in enumerate(self.slots) if (h := s.header()) and h.get("state") == "ready"]
        return max(steps)[1] if steps else None

    def _targets(self, persist: bool, wait: bool) -> list[Slot]:
        """The slots a snapshot may go into, in turn: the older one; if it turns out busy (and
        the snapshot is not to be waited for), the newest, when the older one is complete (its
        reader holds it: one complete snapshot stays) and the newest is not a snapshot flagged
        for persisting that this one, not flagged, would take from the saver."""
        newest = self._newest()
        if newest is None:
            return [self.slots[0]]
        older, latest = self.slots[1 - newest], self.slots[newest]
        if wait or not ((h := older.header()) and h.get("state") == "ready"):
            return [older]
        return [older] if (latest.header() or {}).get("persist") and not persist else [older, latest]

    def snapshot(self, step: int, state, persist: bool, wait: bool = False) -> float | None:
        """Copy ``state`` into the older slot (or the newest, see the module's policy); returns
        the blocking seconds, or None if no slot was free and ``wait`` is False (skipped)."""
        t0 = time.perf_counter()
        for target in self._targets(persist, wait):
            with target.lock(exclusive=True, blocking=wait) as held:
                if held:
                    target.write(
                        state,
                        {
                            "step": step,
                            "rank": self.rank,
                            "world_size": self.world_size,
                            "pid": os.getpid(),
                            "persist": persist,
                            "time": time.time(),
                        },
                    )
                    break
        else:
            return None
        blocked = time.perf_counter() - t0
        digest = threading.Thread(target=self._seal, args=(target, step), name=DIGEST_THREAD, daemon=True)
        digest.start()
        self._digests = [t for t in self._digests if t.is_alive()] + [digest]
        return blocked

    @staticmethod
    def _seal(slot: Slot, step: int) -> None:
        with slot.lock(exclusive=False):
            h = slot.header()
            if h and h.get("state") == "ready" and h["step"] == step and not h.get("digest"):
                slot.set_header({**h, "digest": slot.compute_digest(h)})

    def flush(self) -> None:
        """Wait for the digests of the snapshots taken (so the saver may persist them): the one
        before the last may still be sealing when the next snapshot comes soon after it."""
        for digest in self._digests:
            digest.join()
        self._digests = []

    def sealed_steps(self) -> dict[int, int]:
        """step → slot index of every complete, sealed snapshot of this rank (cheap: headers only)."""
        self.flush()
        found = {}
        for i, slot in enumerate(self.slots):
            h = slot.sealed()
            if h and h["rank"] == self.rank and h["world_size"] == self.world_size:
                found[h["step"]] = i
        return found

    def verify(self, step: int) -> bool:
        """Does this rank's snapshot of ``step`` match its digest?"""
        slot_index = self.sealed_steps().get(step)
        if slot_index is None:
            return False
        with self.slots[slot_index].lock(exclusive=False):
            h = self.slots[slot_index].verified()
        return bool(h) and h["step"] == step

    def load_local(self, local_rank: int, rank: int, step: int):
        """Another local rank's verified snapshot of ``step`` (copied out of shared memory), read
        from its slots on this node; None if it holds none. Every rank of a job of one node reads
        rank 0's replicated state so, instead of having it sent over the process group."""
        for path in slot_paths(self.ns, local_rank):
            if not path.exists():
                continue
            slot = Slot(path)
            try:
                with slot.lock(exclusive=False):
                    h = slot.verified()
                    if h and (h["step"], h["rank"], h["world_size"]) == (step, rank, self.world_size):
                        return slot.read(h, clone=True)
            finally:
                slot.close()
        return None

    def replicated_elsewhere(self) -> dict[int, Path]:
        """step → slot file of each sealed snapshot on this node of another world size's rank 0
        (the replicated state under DDP) — what a job that lost a node without a standby (or took
        one in) left in this node's shared memory. Headers only."""
        found: dict[int, Path] = {}
        for path in sorted(self.ns.glob("rank*.slot*")):
            h = read_header(path)
            if (
                h
                and h.get("state") == "ready"
                and h.get("digest")
                and h.get("rank") == 0
                and h.get("world_size") != self.world_size
                and isinstance(h.get("step"), int)
            ):
                found.setdefault(h["step"], path)
        return found

    def load_replicated(self, step: int):
        """The snapshot of ``step`` that ``replicated_elsewhere`` lists, copied out, if it still
        matches its digest; else None."""
        path = self.replicated_elsewhere().get(step)
        if path is None:
            return None
        slot = Slot(path)
        try:
            with slot.lock(exclusive=False):
                h = slot.verified()
                return slot.read(h, clone=True) if h and h["step"] == step and h["rank"] == 0 else None
        finally:
            slot.close()

    def load(self, step: int):
        """This rank's snapshot of ``step`` (copied out of shared memory); call ``verify`` first."""
        slot = self.slots[self.sealed_steps()[step]]
        with slot.lock(exclusive=False):
            h = slot.sealed()
            if h is None or h["step"] != step:
                raise RuntimeError(f"snapshot of step {step} changed while restoring from {slot.path}")
            return slot.read(h, clone=True)
