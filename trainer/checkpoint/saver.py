"""The node's checkpoint saver, started as ``python -m trainer.saver --ns SHM_DIR --nproc N --job JOB.json``.

Started by the node agent (``trainer.launch``) before the workers and kept alive across their
restarts. It watches the node's shared-memory slots and persists a snapshot when every local
rank holds a verified snapshot of the same step and that step was flagged ``persist`` — or,
after a worker died (*save at breakpoint*, ``BREAKPOINT_DELAY_S`` later), the newest such step
even if it was not flagged.

Under DDP rank 0's slot holds the replicated model state (persisted as ``model.pt``); under
FSDP every rank's slot holds its piece (``model_shard_XXXXX.pt``), and the checkpoint commits
only once every rank's piece is there.

Commit protocol: each rank's shards are written durably → this node's record (its shard
digests) → once the records of all ranks are present, the manifest → the ``latest`` pointer,
last, and only forwards. A saver killed at any point leaves no committed torn checkpoint.

Only one saver ever writes the manifest and the pointer: the one whose node holds rank 0 (the
*committer*). The others only write shards and their node record; the committer keeps the
steps it persisted as pending and commits each once every node's record is there. With a
single writer the pointer cannot move backwards (no read-then-write race between nodes).

A saver of a superseded job (``trainer.checkpoint.fence``) writes nothing. A persist that fails (disk
full, storage error) removes the shards it wrote, leaves the previous checkpoint as the resume
point and ends the saver with its error (``saver.error`` in the snapshot directory) for the
node agent, which restarts it with backoff — training goes on on its memory snapshots — and
fails the job after ``saver_max_failures`` failures in a row.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from pathlib import Path

from trainer.checkpoint import fence
from trainer.checkpoint import store as ckpt
from trainer.checkpoint.corrupt import corrupt_committed
from trainer.checkpoint.shm import Slot, read_header, slot_paths
from trainer.checkpoint.store import stage_store
from trainer.common.atomic import atomic_write_bytes, atomic_write_json
from trainer.common.diskfull import describe, is_disk_full
from trainer.common.process import pid_alive
from trainer.job.config import Drill, JobConfig
from trainer.job.events import EventKind
from trainer.job.reporting import JsonLines
from trainer.storage import StorageError

POLL_S = 0.05
# a save at breakpoint starts this long after a worker died: the recovery gets the CPU first (a fast
# one takes 0.1-0.5 s; persisting beside it made it 0.05-0.2 s slower on two cores), and the
# snapshots the save would persist stay in shared memory meanwhile (the final save on the way out
# is not delayed)
BREAKPOINT_DELAY_S = 1.0
FINAL_COMMIT_WAIT_S = 5.0  # on the way out, how long the committer waits for other nodes' shards
ERROR_FILE = (
    "saver.error"  # in the snapshot directory: the last saver's error, for the node agent ({"error_type", "error"})
)
PROGRESS_FILE = "saver.progress"  # in the snapshot directory: touched after each persisted step


class SupersededJob(RuntimeError):
    """A newer job of the stage claimed the checkpoint location; this job's saver writes nothing."""


class CheckpointDiskFull(RuntimeError):
    """The checkpoint location is full; the message names the file system, the bytes needed and
    the retention setting to change."""


class Saver:
    def __init__(
        self,
        ns: Path,
        nproc: int,
        store: ckpt.CheckpointStore,
        keep: int,
        events: JsonLines | None,
        drills: list[Drill] = (),
        job_dir: str | None = None,
        meta: dict | None = None,
        fence_owner: str | None = None,
        lease: fence.LeaseFence | None = None,
        agent: int | None = None,
    ):
        # the node agent this saver serves (its events name it; the saver ends when it is gone):
        # not always the parent process (a saver forked by the zygote is the zygote's child)
        self.agent = os.getppid() if agent is None else agent
        self.ns, self.nproc, self.store, self.keep, self.events = ns, nproc, store, keep, events
        self.fence_owner = fence_owner  # the job this saver commits for (None: no fencing)
        self.lease = lease  # the campaign lease generation its job runs under (None: no lease)
        self._deferred: str | None = None  # why the last commit waited for the lease (one event per reason)
        self.superseded = False  # a newer job claimed the checkpoint location: write nothing more
        self.drills, self.job_dir = list(drills), job_dir  # chaos drills acted on by the saver
        self.meta = meta or {}  # recorded in every manifest (JobConfig.checkpoint_meta)
        # set by SIGTERM's handler: a plain flag, never a lock. The handler runs on the main
        # thread between two bytecodes — inside Event.wait() that thread may hold the Event's
        # lock, and an Event.set() from the handler then waits for it forever (seen: a saver
        # that did not end on SIGTERM)
        self.stopping = False
        self._dead_seen: set[int] = set()
        self.pending: dict[int, int] = {}  # committer only: persisted step -> world size, not yet committed

    def _emit(self, record: dict) -> None:
        if self.events is not None:
            self.events.write({"source": "saver", "agent": self.agent, **record})

    def headers(self) -> list[list[dict]]:
        """Per local rank, the headers of its ready slots."""
        out = []
        for lr in range(self.nproc):
            hs = []
            for p in slot_paths(self.ns, lr):
                if (h := read_header(p)) and h.get("state") == "ready":
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

    def fenced(self, step: int) -> bool:
        """Has a newer job claimed the checkpoint location, or another run of the campaign taken
        its lease? (Then this saver refuses to write, for good.) A lease that cannot be read now
        holds this write back (True) without giving up: the next poll tries again."""
        owner = fence.superseded(self.store, self.fence_owner)
        reason = (
            (
                f"{self.store.location} is claimed by a newer job ({owner}); this saver's job "
                f"({self.fence_owner}) was superseded, so it writes nothing"
            )
            if owner is not None
            else None
        )
        if reason is None and self.lease is not None:
            try:
                reason = self.lease.fenced()
            except (StorageError, fence.LeaseRecordDamaged) as err:
                if str(err) != self._deferred:
                    self._deferred = str(err)
                    self._emit({"event": EventKind.COMMIT_DEFERRED, "step": step, "reason": str(err)})
                return True
        if reason is not None:
            self.superseded = True
            self.pending.clear()
            self.stopping = True
            self._emit({"event": EventKind.COMMIT_REFUSED, "step": step, "reason": reason})
        return reason is not None

    def persist(self, step: int) -> bool:
        """Write this node's shards of ``step`` (and commit it, on the committer); a failure
        removes what it wrote and raises (CheckpointDiskFull when the location is full)."""
        if self.fenced(step):
            return False
        entries: list[dict] = []
        try:
            return self._persist(step, entries)
        except Exception as err:
            self._discard(step, entries)
            if is_disk_full(err):
                need = sum(h["data_len"] for hs in self.headers() for h in hs if h["step"] == step)
                resume = self.store.read_pointer()
                raise CheckpointDiskFull(
                    describe(
                        self.store.location,
                        need,
                        f"checkpoint step {step}",
                        f"Free space there, or keep fewer checkpoints: lower checkpoint.keep (now {self.keep}). "
                        f"The previous checkpoint ({'none' if resume is None else f'step {resume}'}) stays the resume "
                        f"point.",
                    )
                )
            raise

    def _discard(self, step: int, entries: list[dict]) -> None:
        """After a failed persist of an uncommitted step: remove its manifest (if the pointer
        write failed after it) and the shards this saver wrote, giving the space back."""
        if (self.store.read_pointer() or -1) >= step:
            return  # committed after all (a later step failed): nothing to take back
        self.store.storage.delete(f"{ckpt.step_name(step)}/{ckpt.MANIFEST}")
        for e in entries:
            self.store.storage.delete(f"{ckpt.step_name(step)}/{e['name']}")

    def _persist(self, step: int, entries: list[dict]) -> bool:
        t0 = time.perf_counter()
        world = None
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
                        if "shared" in state:  # DDP: rank 0's replica
                            entries.append(self.store.write_shard(step, ckpt.MODEL_SHARD, state["shared"]))
                        if "shard" in state:  # FSDP: this rank's piece
                            entries.append(
                                self.store.write_shard(step, ckpt.model_shard_name(h["rank"]), state["shard"])
                            )
                        entries.append(self.store.write_shard(step, ckpt.rank_shard_name(h["rank"]), state["rank"]))
                        del state
                        break
                finally:
                    slot.close()
            else:
                self._emit(
                    {
                        "event": EventKind.PERSIST_SKIPPED,
                        "step": step,
                        "reason": f"no verified snapshot in {path.parent}",
                    }
                )
                return False
        self.store.write_node_record(step, min(e["name"] for e in entries).removesuffix(".pt"), world, entries)
        if any(e["name"] == ckpt.rank_shard_name(0) for e in entries):  # this node commits
            self.pending[step] = world
            self.commit_ready()
        atomic_write_bytes(self.ns / PROGRESS_FILE, str(step).encode())
        self._emit({"event": EventKind.PERSISTED, "step": step, "persist_s": time.perf_counter() - t0})
        return True

    def commit_ready(self) -> None:
        """Commit, oldest first, the pending steps whose shards every node has persisted; a
        step older than the pointer is dropped (a newer one was committed meanwhile)."""
        for step in sorted(self.pending):
            world = self.pending[step]
            if (self.store.read_pointer() or -1) >= step:
                del self.pending[step]
                continue
            shards = self.store.node_shards(step)
            names = {s["name"] for s in shards}
            if not ckpt.model_files(names, world) or any(ckpt.rank_shard_name(r) not in names for r in range(world)):
                continue  # other nodes have not finished their shards yet
            sharded = bool(ckpt.model_shard_ranks(names))
            if self.fenced(step):  # checked immediately before the manifest and the pointer
                return
            ref = self.store.commit(
                step,
                shards,
                {
                    **self.meta,
                    "world_size": world,
                    "persisted_by": "saver",
                    "parallelism": "fsdp" if sharded else "ddp",
                },
            )
            del self.pending[step]
            self.store.prune(self.keep)
            self._emit({"event": EventKind.CHECKPOINT, "step": step, "path": ref.location})
            if self.drills:
                corrupt_committed(self.drills, self.job_dir, self.store, step, self._emit)

    def run(self) -> None:
        committed = self.store.read_pointer() or -1
        breakpoint_at = None  # when the save at breakpoint a worker's death asked for is due
        while not self.stopping and pid_alive(self.agent):
            step = self.candidate(breakpoint=False)
            if self.newly_dead_workers() and breakpoint_at is None:
                breakpoint_at = time.monotonic() + BREAKPOINT_DELAY_S
            if (step is None or step <= committed) and breakpoint_at is not None and time.monotonic() >= breakpoint_at:
                breakpoint_at = None
                step = self.candidate(breakpoint=True)
                if step is not None and step > committed:
                    self._emit({"event": EventKind.BREAKPOINT_SAVE, "step": step})
            if step is not None and step > committed and self.persist(step):
                committed = step
            if self.pending:
                self.commit_ready()
            time.sleep(POLL_S)  # the poll interval (no Event.wait: see `stopping`)
        if self.superseded:
            return
        step = self.candidate(breakpoint=True)  # final breakpoint save on the way out
        if step is not None and step > (self.store.read_pointer() or -1):
            self.persist(step)
        deadline = time.monotonic() + FINAL_COMMIT_WAIT_S
        while self.pending and time.monotonic() < deadline:  # other nodes may still be writing theirs
            self.commit_ready()
            time.sleep(POLL_S)


def serve(ns: Path, nproc: int, job_path: Path, agent: int | None = None) -> int:
    """Run the node's saver until SIGTERM (then save at breakpoint); the process's exit code.
    A failure is written to ``ns/saver.error`` for the node agent."""
    job = JobConfig.load(job_path)
    saver = Saver(
        ns,
        nproc,
        stage_store(job),
        job.checkpoint.keep,
        JsonLines(job.layout.events),
        drills=job.chaos,
        job_dir=job.job_dir,
        meta=job.checkpoint_meta(),
        fence_owner=job.job_dir,
        lease=fence.LeaseFence.of_job(job.lease, job.checkpoint.options),
        agent=agent,
    )
    signal.signal(signal.SIGTERM, lambda *_: setattr(saver, "stopping", True))  # finish, save at breakpoint, exit
    saver._emit({"event": EventKind.SAVER_START})
    try:
        saver.run()
        if saver.superseded:
            raise SupersededJob(
                f"a newer job claimed {saver.store.location} (see its {fence.FENCE} record) or another "
                f"run took the campaign's lease over: this job ({job.job_dir}) no longer commits "
                "checkpoints there (its commit_refused event says which)"
            )
    except Exception as err:  # noqa: BLE001 - reported to the node agent, which restarts or fails the job
        message = f"{type(err).__name__}: {err}"
        atomic_write_json(ns / ERROR_FILE, {"error_type": type(err).__name__, "error": message})
        saver._emit({"event": EventKind.SAVER_ERROR, "error": message, "traceback": traceback.format_exc()[-2000:]})
        print(f"checkpoint saver failed: {message}", file=sys.stderr, flush=True)
        return 1
    return 0
