"""The node agent's snapshot directory in shared memory (``<shm_dir>/pretrain-<agent pid>-<job>``)
and the sweep of directories left by agents that died without cleaning up (SIGKILL, OOM kill,
a lost node): each leak holds ~6× the model's bytes of the node's memory for good.

A directory records its owner — pid, the process's start time (a recycled pid is not the
owner) and its pid namespace (a pid is only meaningful in its own namespace). A directory is
swept only when its owner is known to be dead and none of its slots is locked; a directory
whose owner is alive, or cannot be judged, is never touched: another campaign may be running
on the same node.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from trainer.common.atomic import atomic_write_json
from trainer.common.process import pid_alive

PREFIX = "pretrain-"
_NAME = re.compile(r"^pretrain-(\d+)-[0-9a-f]{10}$")
OWNER_FILE = "owner.json"


def process_start(pid: int) -> int | None:
    """The process's start time (clock ticks after boot, /proc/<pid>/stat field 22); None if
    the process does not exist or /proc cannot tell."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def pid_namespace(pid: int | str = "self") -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def owner_record(pid: int | None = None) -> dict:
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "start": process_start(pid), "pid_ns": pid_namespace(pid)}


def create(shm_dir: str | Path, job_dir: str) -> Path:
    """This agent's snapshot directory, with its owner record."""
    ns = Path(shm_dir) / f"{PREFIX}{os.getpid()}-{hashlib.sha256(job_dir.encode()).hexdigest()[:10]}"
    ns.mkdir(parents=True, exist_ok=True)
    atomic_write_json(ns / OWNER_FILE, {**owner_record(), "job_dir": job_dir})
    return ns


def owner_dead(ns: Path) -> bool:
    """Is the directory's owner known to be gone? (False whenever in doubt.)"""
    m = _NAME.match(ns.name)
    if not m:
        return False  # not a snapshot directory of ours
    try:
        owner = json.loads((ns / OWNER_FILE).read_text())
        pid, start, ns_id = int(owner["pid"]), owner.get("start"), owner.get("pid_ns")
    except FileNotFoundError:  # being created this instant, or made before owner records existed
        pid, start, ns_id = int(m.group(1)), None, None
    except (OSError, ValueError, TypeError, KeyError):  # damaged record: the name still holds the pid
        pid, start, ns_id = int(m.group(1)), None, None
    if ns_id is not None and ns_id != pid_namespace():
        return False  # another pid namespace (a container sharing /dev/shm): its pids mean nothing here
    if not pid_alive(pid):
        return True
    return start is not None and process_start(pid) not in (None, start)  # the pid was recycled


def in_use(ns: Path) -> bool:
    """Does any process hold a lock on one of the directory's slots (a saver or worker still at work)?"""
    for slot in ns.glob("rank*.slot*"):
        try:
            fd = os.open(slot, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
    return False


def sweep_orphans(shm_dir: str | Path) -> list[tuple[Path, int]]:
    """Delete the snapshot directories in ``shm_dir`` whose owner agent is dead; returns each
    one swept with the bytes it freed. The agents of a local cluster start together and sweep
    the same directory: one that finds a directory (or a file of it) gone meanwhile leaves it to
    the agent sweeping it."""
    root = Path(shm_dir)
    if not root.is_dir():
        return []
    swept = []
    for ns in sorted(root.glob(f"{PREFIX}*")):
        try:
            if not (ns.is_dir() and not ns.is_symlink() and owner_dead(ns) and not in_use(ns)):
                continue
            size = sum(f.stat().st_size for f in ns.iterdir() if f.is_file())
        except FileNotFoundError:  # another agent is sweeping it
            continue
        shutil.rmtree(ns, ignore_errors=True)
        swept.append((ns, size))
    return swept
