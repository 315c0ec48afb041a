"""Where the test suite's CPU goes: the machine's busy CPU seconds during each test, per file.

The suite is CPU-bound on 2 cores (``.ci/run``'s wall time is about its CPU seconds / 2), so
CPU seconds, not wall seconds, say what to make cheaper. Measured machine-wide (``/proc/stat``)
so the processes a test starts (campaigns, servers, workers) count; run it serially on an idle
machine, or the numbers include everything else running:

    PYTHONPATH=bench pytest -p suite_cpu -n 0 -p no:cacheprovider     # writes suite-cpu.jsonl
    python bench/suite_cpu.py suite-cpu.jsonl                          # the table, per file

``SUITE_CPU_OUT`` names the output file; ``SUITE_CPU_SKIP`` a previous output whose tests are
left out (to go on after a stop). Linux only.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

import pytest


def busy_cpu_s() -> float:
    """Seconds every CPU of the machine spent busy (not idle, not waiting for I/O) since boot."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def pytest_configure(config):
    config._suite_cpu_out = open(os.environ.get("SUITE_CPU_OUT", "suite-cpu.jsonl"), "a")


def pytest_collection_modifyitems(config, items):
    skip = os.environ.get("SUITE_CPU_SKIP")
    if skip:
        with open(skip) as f:
            done = {json.loads(line)["id"] for line in f if line.strip()}
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid in done])
        items[:] = [i for i in items if i.nodeid not in done]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = busy_cpu_s(), time.monotonic()
    yield
    out = item.config._suite_cpu_out
    out.write(
        json.dumps(
            {"id": item.nodeid, "cpu_s": round(busy_cpu_s() - cpu, 2), "wall_s": round(time.monotonic() - wall, 2)}
        )
        + "\n"
    )
    out.flush()


def table(path: str, top: int = 25) -> str:
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                entry = files[row["id"].split("::")[0]]
                entry[0] += row["cpu_s"]
                entry[1] += row["wall_s"]
                entry[2] += 1
    total = sum(v[0] for v in files.values())
    lines = [f"{'CPU-s':>8} {'share':>6} {'wall-s':>8} {'tests':>5}  file"]
    for name, (cpu, wall, n) in sorted(files.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{cpu:8.1f} {cpu / total:6.1%} {wall:8.1f} {n:5d}  {name}")
    lines.append(
        f"{total:8.1f} {1:6.0%} {sum(v[1] for v in files.values()):8.1f} {sum(v[2] for v in files.values()):5d}  all"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(
            "usage: python bench/suite_cpu.py suite-cpu.jsonl (written by: PYTHONPATH=bench pytest -p suite_cpu -n 0)"
        )
    try:
        print(table(sys.argv[1]))
    except (OSError, ValueError, KeyError) as err:
        sys.exit(f"cannot read {sys.argv[1]}: {err}")
