"""The benchmarks the runner knows: every ``bench/<name>.py`` script, found by reading the
directory (a benchmark added later, e.g. ``chaos_goodput``, is picked up without an import that
would fail before it exists, and without importing torch or Prefect in the runner).

A script describes itself with a module-level literal, read with :mod:`ast` (never executed)::

    BENCH = {"title": "Trainer overhead", "order": 30, "quick": ["--steps", "4"], "full": [],
             "timeout_s": 600}

A script without ``BENCH`` still runs: its title is its docstring's first line, its full run has
no arguments, and its quick run passes ``--quick``, or ``--minutes 1`` (and ``--fault-every 20``),
when its source has such an option (else the full arguments).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOT_BENCHMARKS = {"__init__", "__main__", "registry", "results", "document", "machine", "runner", "synthetic"}


@dataclass
class Benchmark:
    name: str  # the module name: bench/<name>.py
    title: str
    path: Path
    full: list[str] = field(default_factory=list)
    quick: list[str] = field(default_factory=list)
    order: int = 100
    timeout_s: int = 1800

    def args(self, quick: bool) -> list[str]:
        return list(self.quick if quick else self.full)

    def command(self, quick: bool) -> str:
        """How a reader reruns it alone."""
        return " ".join(["python", f"bench/{self.path.name}", *self.args(quick)])


def _literal(tree: ast.Module, name: str):
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                return None
    return None


def describe(path: Path) -> Benchmark | None:
    """The benchmark in ``path``; None when it cannot be parsed (the runner says so)."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    doc = (ast.get_docstring(tree) or path.stem).strip().splitlines()[0].rstrip(".:")
    meta = _literal(tree, "BENCH")
    meta = meta if isinstance(meta, dict) else {}
    full = [str(a) for a in meta.get("full", [])]
    if "quick" in meta:
        quick = [str(a) for a in meta["quick"]]
    elif '"--quick"' in source:
        quick = ["--quick"]
    elif '"--minutes"' in source:  # a campaign filling N minutes (chaos_goodput): one, with faults 4× as often
        quick = ["--minutes", "1"] + (["--fault-every", "20"] if '"--fault-every"' in source else [])
    else:
        quick = full
    return Benchmark(
        name=path.stem,
        title=str(meta.get("title", doc)),
        path=path,
        full=full,
        quick=quick,
        order=int(meta.get("order", 100)),
        timeout_s=int(meta.get("timeout_s", 1800)),
    )


def discover(directory: Path = HERE) -> tuple[list[Benchmark], list[str]]:
    """The benchmarks in ``directory`` in their order, and the files that could not be read."""
    found, broken = [], []
    for path in sorted(directory.glob("*.py")):
        if path.stem in NOT_BENCHMARKS or path.stem.startswith("_"):
            continue
        b = describe(path)
        if b is None:
            broken.append(path.name)
        else:
            found.append(b)
    return sorted(found, key=lambda b: (b.order, b.name)), broken
