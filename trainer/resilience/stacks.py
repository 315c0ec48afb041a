"""Where a hung worker was: every thread's Python stack, taken before the worker is killed.

A worker asks for its stacks to be written to a file on ``DUMP_SIGNAL`` (``faulthandler``: the
dump is written from the signal handler itself, so it works while the main thread is blocked
in a C call — a collective, a lock, a read). The file is one per node agent and local rank,
next to the worker's heartbeat record (a replacement truncates its predecessor's: the hang
detector has read it by then). The hang detector signals a hung worker, waits for the dump,
keeps it in the job's directory (``stacks/``) and names the innermost frames in its hang event,
then kills the worker. ``kill -USR1 <worker pid>`` gives a person the same dump of a live one.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import sys
import time
from pathlib import Path

from trainer.common.atomic import atomic_write_bytes
from trainer.common.process import signal_process
from trainer.job.layout import JobLayout

DUMP_SIGNAL = signal.SIGUSR1
DUMP_WAIT_S = 2.0  # the most a hung worker's kill waits for its stacks (a loaded machine schedules it late)
POLL_S = 0.01
ROOT = str(Path(__file__).resolve().parents[2])  # this project's checkout (or its installed packages)
OURS = tuple(os.path.join(ROOT, d) + os.sep for d in ("trainer", "pretrain", "flows", "tasks"))  # our code's frames
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def stack_path(heartbeat_path: Path) -> Path:
    """The dump file of the worker whose heartbeat record is ``heartbeat_path``."""
    return heartbeat_path.with_suffix(".stack")


def dump_on_signal(path: Path) -> None:
    """In a worker: write every thread's stack to ``path`` when ``DUMP_SIGNAL`` arrives (the file
    stays open for the process's life: faulthandler writes to its descriptor)."""
    # appending: the agent empties the file before it asks for a dump, and the next dump starts at 0
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    except OSError as err:  # a full or read-only disk: the worker trains on, its hang is found without its stacks
        print(f"no stack dumps on {DUMP_SIGNAL.name} for this worker: {path}: {err}", file=sys.stderr, flush=True)
        return
    out = os.fdopen(fd, "w")  # owned by faulthandler until the process ends
    faulthandler.register(DUMP_SIGNAL, file=out, all_threads=True, chain=False)


def log_on_signal() -> None:
    """In a node agent: write every thread's stack to its stderr (the node's log) on
    ``DUMP_SIGNAL`` — ``kill -USR1 <agent pid>`` shows where a node that seems stuck is."""
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


def take_dump(pid: int, path: Path, wait_s: float = DUMP_WAIT_S) -> str:
    """In the node agent: signal worker ``pid`` and return what it wrote to ``path`` ("" when it
    wrote nothing within ``wait_s``: not a worker that asked for dumps, or not even its signal
    handler ran)."""
    try:
        os.truncate(path, 0)
    except OSError:
        return ""  # it never asked for dumps (a worker of the release before)
    signal_process(pid, DUMP_SIGNAL)
    deadline, size = time.monotonic() + wait_s, -1
    while time.monotonic() < deadline:
        time.sleep(POLL_S)
        now = _size(path)
        if now > 0 and now == size:  # written, and nothing more came in the last poll
            break
        size = now
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def hung_stacks(job_dir: str | Path, heartbeat_path: Path, hb: dict) -> dict:
    """Take a hung worker's dump (``hb``: its heartbeat record) and keep it in the job's
    ``stacks/`` directory: ``{"rank", "where", "file"}`` (the file relative to the job's
    directory), or just the rank when it wrote none."""
    text = take_dump(hb["pid"], stack_path(heartbeat_path))
    found = where(text)
    if found is None:
        return {"rank": hb["rank"]}
    layout = JobLayout.of(job_dir)
    path = layout.stacks / f"hang-step{hb['step']:08d}-rank{hb['rank']}-pid{hb['pid']}.txt"
    name = path.relative_to(layout.root).as_posix()
    try:
        atomic_write_bytes(path, text.encode())
    except OSError:
        return {"rank": hb["rank"], "where": found}  # a full disk: the frames still reach the event
    return {"rank": hb["rank"], "where": found, "file": name}


def threads(text: str) -> list[list[tuple[str, int, str]]]:
    """A faulthandler dump's threads, each a list of (file, line, function), innermost first."""
    out: list[list[tuple[str, int, str]]] = []
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            out.append([])
        elif out and (m := _FRAME.match(line)):
            out[-1].append((m["file"], int(m["line"]), m["func"]))
    return out


def where(text: str) -> str | None:
    """The main thread's innermost frame, and its innermost frame in this project's code when that
    is another one: e.g. ``all_reduce (torch/distributed/distributed_c10d.py:2950) from
    train_step (trainer/loop.py:210)``; None when the dump holds no frame."""
    found = threads(text)
    # the main thread: the one not started by threading (whose threads' outermost frame is _bootstrap)
    main = next((t for t in found if t and t[-1][2] != "_bootstrap"), next((t for t in found if t), None))
    if not main:
        return None
    inner = main[0]
    ours = next((f for f in main if f[0].startswith(OURS)), None)
    shown = _frame(inner)
    return shown if ours in (None, inner) else f"{shown} from {_frame(ours)}"


def _frame(frame: tuple[str, int, str]) -> str:
    file, line, func = frame
    if file.startswith(OURS):
        file = os.path.relpath(file, ROOT)
    elif "site-packages/" in file:
        file = file.rsplit("site-packages/", 1)[1]
    else:
        file = os.path.basename(file)  # the standard library's
    return f"{func} ({file}:{line})"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1
