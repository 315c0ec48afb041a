"""The node's checkpoint saver: ``python -m trainer.saver --ns SHM_DIR --nproc N --ckpt-dir DIR``.

Started by the node agent (``trainer.launch``) before the workers and kept alive across their
restarts. It watches the node's shared-memory slots and persists a snapshot when every local
rank holds a verified snapshot of the same step and that step was flagged ``persist`` — or,
after a worker died (*save at breakpoint*), the newest such step even if it was not flagged.

Commit protocol: each rank's shards are written durably → this node's record (its shard
digests) → once the records of all ranks are present, the manifest → the ``latest`` pointer,
last, and only forwards. A saver killed at any point leaves no committed torn checkpoint.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

from trainer import checkpoint as ckpt
from trainer.config import JobConfig
from trainer.process import pid_alive
from trainer.reporting import EVENTS, JsonLines
from trainer.shm import Slot, slot_paths

POLL_S = 0.05


class Saver:
    def __init__(self, ns: Path, nproc: int, store: ckpt.CheckpointStore, keep: int, events: JsonLines | None,
                 meta: dict | None = None):
        self.ns, self.nproc, self.store, self.keep, self.events = ns, nproc, store, keep, events
        self.meta = meta or {}  # recorded in every manifest (JobConfig.checkpoint_meta)
        self.stop = threading.Event()
        self._dead_seen: set[int] = set()

    def _emit(self, record: dict) -> None:
        if self.events is not None:
            self.events.write({"source": "saver", "agent": os.getppid(), **record})

    def headers(self) -> list[list[dict]]:
        """Per local rank, the headers of its ready slots."""
        out = []
        for lr in range(self.nproc):
            hs = []
            for p in slot_paths(self.ns, lr):
                if p.exists() and p.stat().st_size:
                    s = Slot(p)
                    h = s.header()
                    s.close()
                    if h and h.get("state") == "ready":
                        hs.append({**h, "_path": str(p)})
            out.append(hs)
        return out

    def candidate(self, breakpoint: bool) -> int | None:
        """Newest step every local rank holds sealed, flagged for persisting unless at a breakpoint."""
        per_rank = self.headers()
        if not all(per_rank):
            return None
        common = set.intersection(*({h["step"] for h in hs if h.get("digest")} for hs in per_rank))
        if not breakpoint:
            common = {s for s in common if any(h["step"] == s and h.get("persist") for hs in per_rank for h in hs)}
        return max(common) if common else None

    def newly_dead_workers(self) -> set[int]:
        """Pids of snapshot writers that died since the last call (each triggers one breakpoint save)."""
        dead = {h["pid"] for hs in self.headers() for h in hs if not pid_alive(h["pid"])} - self._dead_seen
        self._dead_seen |= dead
        return dead

    def persist(self, step: int) -> bool:
        t0 = time.perf_counter()
        entries, world = [], None
        for lr in range(self.nproc):
            path = next(p for p in slot_paths(self.ns, lr) if p.exists())
            for p in slot_paths(self.ns, lr):
                slot = Slot(p)
                try:
                    with slot.lock(exclusive=False):
                        h = slot.verified()
                        if not h or h["step"] != step:
                            continue
                        state = slot.read(h, clone=False)
                        world = h["world_size"]
                        if "shared" in state:
                            entries.append(self.store.write_shard(step, "model.pt", state["shared"]))
                        entries.append(self.store.write_shard(step, ckpt.rank_shard_name(h["rank"]), state["rank"]))
                        del state
                        break
                finally:
                    slot.close()
            else:
                self._emit({"event": "persist_skipped", "step": step, "reason": f"no verified snapshot in {path.parent}"})
                return False
        self.store.write_node_record(step, min(e["name"] for e in entries).removesuffix(".pt"), world, entries)
        self.try_commit(step, world)
        self._emit({"event": "persisted", "step": step, "persist_s": time.perf_counter() - t0})
        return True

    def try_commit(self, step: int, world: int) -> None:
        shards = self.store.node_shards(step)
        names = {s["name"] for s in shards}
        if "model.pt" not in names or any(ckpt.rank_shard_name(r) not in names for r in range(world)):
            return  # other nodes have not finished their shards yet
        if (self.store.read_pointer() or -1) >= step:
            return
        ref = self.store.commit(step, shards, {**self.meta, "world_size": world, "persisted_by": "saver"})
        self.store.prune(self.keep)
        self._emit({"event": "checkpoint", "step": step, "path": ref.location})

    def run(self) -> None:
        committed = self.store.read_pointer() or -1
        parent = os.getppid()
        while not self.stop.is_set() and os.getppid() == parent:
            step = self.candidate(breakpoint=False)
            if (step is None or step <= committed) and self.newly_dead_workers():
                step = self.candidate(breakpoint=True)
                if step is not None and step > committed:
                    self._emit({"event": "breakpoint_save", "step": step})
            if step is not None and step > committed and self.persist(step):
                committed = step
            self.stop.wait(POLL_S)
        step = self.candidate(breakpoint=True)  # final breakpoint save on the way out
        if step is not None and step > (self.store.read_pointer() or -1):
            self.persist(step)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.saver")
    p.add_argument("--ns", type=Path, required=True, help="the node's shared-memory snapshot directory")
    p.add_argument("--nproc", type=int, required=True, help="workers on this node")
    p.add_argument("--job", type=Path, required=True, help="the job config: checkpoint location, retention, job dir")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    job = JobConfig.load(args.job)
    saver = Saver(args.ns, args.nproc, job.checkpoints(), job.ckpt_keep, JsonLines(Path(job.job_dir) / EVENTS),
                  meta=job.checkpoint_meta())
    signal.signal(signal.SIGTERM, lambda *_: saver.stop.set())  # finish, save at breakpoint, exit
    saver._emit({"event": "saver_start"})
    saver.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
