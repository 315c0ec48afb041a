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
from trainer.atomic import atomic_write_json, read_json
from trainer.reporting import JsonLines
from trainer.shm import Slot, slot_paths

POLL_S = 0.05
GOOD_POINTER = "good"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class Saver:
    def __init__(self, ns: Path, nproc: int, ckpt_dir: Path, keep: int, events: JsonLines | None):
        self.ns, self.nproc, self.ckpt_dir, self.keep, self.events = ns, nproc, ckpt_dir, keep, events
        self.stop = threading.Event()
        self._dead_seen: set[int] = set()

    def _emit(self, record: dict) -> None:
        if self.events is not None:
            self.events.write({"source": "saver", **record})

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
        dead = {h["pid"] for hs in self.headers() for h in hs if not _alive(h["pid"])} - self._dead_seen
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
                            entries.append(ckpt.write_shard(self.ckpt_dir, step, "model.pt", state["shared"]))
                        entries.append(ckpt.write_shard(self.ckpt_dir, step, ckpt.rank_shard_name(h["rank"]), state["rank"]))
                        del state
                        break
                finally:
                    slot.close()
            else:
                self._emit({"event": "persist_skipped", "step": step, "reason": f"no verified snapshot in {path.parent}"})
                return False
        d = ckpt.step_dir(self.ckpt_dir, step)
        atomic_write_json(d / f"node_{min(e['name'] for e in entries)}.json", {"world_size": world, "shards": entries})
        self.try_commit(step, world)
        self._emit({"event": "persisted", "step": step, "persist_s": time.perf_counter() - t0})
        return True

    def try_commit(self, step: int, world: int) -> None:
        d = ckpt.step_dir(self.ckpt_dir, step)
        shards = [s for rec in sorted(d.glob("node_*.json")) for s in read_json(rec)["shards"]]
        names = {s["name"] for s in shards}
        if "model.pt" not in names or any(ckpt.rank_shard_name(r) not in names for r in range(world)):
            return  # other nodes have not finished their shards yet
        if (ckpt.read_pointer(self.ckpt_dir) or -1) >= step:
            return
        ref = ckpt.commit(self.ckpt_dir, step, shards, {"world_size": world, "persisted_by": "saver"})
        good = read_json(self.ckpt_dir / GOOD_POINTER)
        ckpt.prune(self.ckpt_dir, self.keep, protect={good["step"]} if good else set())
        self._emit({"event": "checkpoint", "step": step, "path": str(ref.path)})

    def run(self) -> None:
        committed = ckpt.read_pointer(self.ckpt_dir) or -1
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
        if step is not None and step > (ckpt.read_pointer(self.ckpt_dir) or -1):
            self.persist(step)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.saver")
    p.add_argument("--ns", type=Path, required=True, help="the node's shared-memory snapshot directory")
    p.add_argument("--nproc", type=int, required=True, help="workers on this node")
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--events", type=Path)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    saver = Saver(args.ns, args.nproc, args.ckpt_dir, args.keep, JsonLines(args.events) if args.events else None)
    signal.signal(signal.SIGTERM, lambda *_: saver.stop.set())  # finish, save at breakpoint, exit
    saver._emit({"event": "saver_start"})
    saver.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
