"""Facts about the machine a benchmark ran on, read without importing torch (the runner stays
light): CPU model, cores, memory, GPUs, torch version, load, date, the code's commit."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import subprocess
from importlib import metadata
from pathlib import Path


def _first(path: str, key: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    if not shutil.which(cmd[0]):
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def facts(root: Path) -> dict[str, str]:
    """Name → value, each a short string ("unknown" where it could not be read)."""
    mem_kib = _first("/proc/meminfo", "MemTotal")
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    gpus = _run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"])
    commit = _run(["git", "rev-parse", "--short", "HEAD"], cwd=root)
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root)
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _first("/proc/cpuinfo", "model name") or "unknown",
        "cores": str(os.cpu_count() or "unknown"),
        "memory": f"{int(mem_kib.split()[0]) / 2**20:.0f} GiB" if mem_kib else "unknown",
        "gpu": gpus.replace("\n", "; ") if gpus else "none",
        "torch": torch_version,
        "load average": " / ".join(f"{x:.1f}" for x in os.getloadavg()),
        "commit": (commit or "unknown") + (" (with uncommitted changes)" if dirty else ""),
    }


def one_line(f: dict[str, str]) -> str:
    return (
        f"{f['date']}, {f['cpu']}, {f['cores']} cores, {f['memory']}, GPU: {f['gpu']}, torch {f['torch']}, "
        f"load average {f['load average']}, commit {f['commit']}"
    )
