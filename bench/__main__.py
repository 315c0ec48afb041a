"""Run every benchmark and rewrite docs/benchmarks.md.

    python -m bench [--quick] [--only NAME[,NAME]] [--out docs/benchmarks.md] [--list]

Each benchmark (``bench/<name>.py``, found by :mod:`bench.registry`) runs alone in its own
process, one after the other (none disturbs another), with the worktree's code first on the
path; its printed table, its checks against targets (:mod:`bench.results`) and the machine
facts go into its section of the document. A benchmark that fails or times out is recorded as
such (its last output lines) and the others still run; the exit status is 1 if any failed.
``--quick`` runs the small sizes: a smoke run that proves the benchmarks work, not numbers.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import document, machine, registry
from bench.results import RESULT_ENV, load_result

ROOT = Path(__file__).resolve().parents[1]
NOTES = Path(__file__).resolve().parent / "notes"


def run_one(b: registry.Benchmark, quick: bool, facts_line: str, log) -> document.Section:
    """Run ``b`` in its own process; its section of the document, whatever happened."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{b.name}-") as tmp:
        result = Path(tmp) / "result.json"
        env = {
            **os.environ,
            RESULT_ENV: str(result),
            "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            # campaigns' Prefect API server: a loaded machine can take longer than Prefect's 20 s to start it
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": os.environ.get(
                "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120"
            ),
        }
        cmd = [sys.executable, str(b.path), *b.args(quick)]
        log(f"running {b.name}: {b.command(quick)}")
        t0 = time.perf_counter()
        try:
            out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=b.timeout_s)
            code, stdout, stderr = out.returncode, out.stdout, out.stderr
        except subprocess.TimeoutExpired as err:
            code, stdout, stderr = None, _text(err.stdout), _text(err.stderr)
        wall = time.perf_counter() - t0
        rec = load_result(result)
    if code is None:
        status = f"failed: did not finish within {b.timeout_s} s"
    elif code != 0:
        tail = " | ".join(line.strip() for line in stderr.strip().splitlines()[-3:])[-300:] or "no error output"
        status = f"failed: exit status {code} ({tail})"
    elif rec.get("skipped"):
        status = f"skipped: {rec['skipped']}"
    else:
        status = "ok"
    notes = NOTES / f"{b.name}.md"
    log(f"  {b.name}: {status} in {wall:.0f} s")
    return document.Section(
        name=b.name,
        title=b.title,
        command=b.command(quick),
        machine=facts_line,
        mode="quick" if quick else "full",
        wall_s=wall,
        output=stdout,
        status=status,
        checks=rec["checks"],
        notes=notes.read_text() if notes.is_file() else "",
    )


def _text(raw) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else (raw or "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick", action="store_true", help="small sizes: proves every benchmark runs (numbers are not real)"
    )
    ap.add_argument(
        "--only", default="", help="comma-separated benchmark names (see --list); the others' sections are kept"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and their commands, run nothing")
    a = ap.parse_args(argv)
    found, broken = registry.discover()
    for name in broken:
        print(f"bench/{name} could not be read (syntax error?): fix it to include it", file=sys.stderr)
    if a.list:
        for b in found:
            print(f"{b.name:20s} {b.title}  ({b.command(a.quick)})")
        return 0
    wanted = {n.strip() for n in a.only.split(",") if n.strip()}
    unknown = wanted - {b.name for b in found}
    if unknown:
        print(
            f"no benchmark named {', '.join(sorted(unknown))}; known: {', '.join(b.name for b in found)}",
            file=sys.stderr,
        )
        return 2
    try:
        text = a.out.read_text() if a.out.is_file() else ""
    except (OSError, UnicodeDecodeError):
        text = ""  # an unreadable document is written anew
    kept, after = document.parse(text), document.afterword(text)
    facts_line = machine.one_line(machine.facts(ROOT))
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    sections: list[document.Section | document.Kept] = []
    for b in found:
        if wanted and b.name not in wanted:
            if b.name in kept:
                sections.append(kept[b.name])
            continue
        sections.append(run_one(b, a.quick, facts_line, log))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(
        ["python -m bench", *(["--quick"] if a.quick else []), *([f"--only {a.only}"] if wanted else [])]
    )
    document.write(a.out, sections, command=command, machine=facts_line, after=after)
    log(f"wrote {a.out}")
    return 1 if any(isinstance(s, document.Section) and s.status.startswith("failed") for s in sections) else 0


if __name__ == "__main__":
    sys.exit(main())
