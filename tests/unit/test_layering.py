"""The layers and wings hold, read from the source (the AST, so an import inside a function counts as
much as one at the top of a module): ``trainer/`` (pure torch, runs in workers and pods) imports nothing
from the layers above it, ``pretrain/`` never imports Prefect, each wing keeps to its own rules, and
the wings of ``pretrain/`` and ``trainer/`` import each other without a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("pretrain", "trainer", "flows", "tasks", "blocks", "deployments")


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute names; relative imports resolved to their package."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            found.add(".".join(p for p in (base, node.module or "") if p))
    return found


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def wing(module: str) -> str:
    """``pretrain.state.ledger`` → ``pretrain.state``; a module at a package's root is a wing of its own."""
    parts = module.split(".")
    return ".".join(parts[:2])


def imports_of(folder: str) -> list[tuple[str, str]]:
    """(importing module, imported module) for every import under ``folder``."""
    return [
        (module_name(path), module)
        for path in sorted((ROOT / folder).rglob("*.py"))
        for module in imported_modules(path)
    ]


def violations(folder: str, forbidden: set[str]) -> list[str]:
    return sorted(
        f"{importer} imports {module}"
        for importer, module in imports_of(folder)
        if any(module == f or module.startswith(f + ".") for f in forbidden)
    )


@pytest.mark.parametrize(
    "layer, forbidden",
    [
        ("trainer", {"pretrain", "flows", "tasks", "blocks", "deployments", "prefect", "mlflow"}),
        # pretrain/cli/, the command line at the top, starts a campaign through deployments/
        ("pretrain", {"flows", "tasks", "blocks", "prefect"}),
    ],
)
def test_a_layer_imports_nothing_above_it(layer, forbidden):
    wrong = violations(layer, forbidden)
    assert not wrong, f"{layer}/ must not import {sorted(forbidden)}:\n" + "\n".join(wrong)


WING_RULES = {
    # only the command line reaches up into deployments/ (to start a campaign)
    **{
        f"pretrain/{w}": {"deployments"}
        for w in ("spec", "state", "data", "cluster", "run", "checkpoints", "tracking", "views")
    },
    # the spec is read by everyone and reads nothing of a campaign's state, data, jobs or views
    "pretrain/spec": {
        "deployments",
        *(f"pretrain.{w}" for w in ("cli", "state", "data", "cluster", "run", "checkpoints", "views")),
    },
    # a campaign's state is below every wing that acts on it
    "pretrain/state": {"deployments", *(f"pretrain.{w}" for w in ("cli", "run", "checkpoints", "views", "cluster"))},
    # views read; the lock, the lease, the guard and the outcome records are for those that write
    "pretrain/views": {
        "deployments",
        "pretrain.cli",
        "pretrain.state.lease",
        "pretrain.state.guard",
        "pretrain.run.outcome",
        "pretrain.run.stop",
        "trainer.common.atomic",
    },
    # what a rank runs and the job contract know nothing of the agents that start them
    "trainer/job": {"trainer.agent", "trainer.zygote", "trainer.loop", "trainer.worker", "trainer.resilience"},
    "trainer/common": {
        f"trainer.{w}" for w in ("job", "agent", "zygote", "data", "checkpoint", "storage", "resilience")
    },
    "trainer/storage": {f"trainer.{w}" for w in ("job", "agent", "zygote", "data", "checkpoint", "resilience")},
    "trainer/checkpoint": {"trainer.agent", "trainer.resilience", "trainer.loop", "trainer.worker"},
    "trainer/data": {"trainer.agent", "trainer.checkpoint", "trainer.resilience", "trainer.loop", "trainer.job"},
}


@pytest.mark.parametrize("folder, forbidden", sorted(WING_RULES.items()))
def test_a_wing_keeps_to_its_rules(folder, forbidden):
    wrong = violations(folder, forbidden)
    assert not wrong, f"{folder}/ must not import {sorted(forbidden)}:\n" + "\n".join(wrong)


def ledger_writes() -> set[str]:
    """The campaign ledger's methods that change it (``pretrain/state/ledger.py``)."""
    tree = ast.parse((ROOT / "pretrain" / "state" / "ledger.py").read_text())
    ledger = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Ledger")
    names = {n.name for n in ledger.body if isinstance(n, ast.FunctionDef)}
    writes = {n for n in names if n.startswith(("set_", "record_", "add_", "begin_", "start_"))}
    return writes | {"save", "mutate", "timed"}


def test_views_never_write_campaign_state():
    calls = sorted(
        f"{path.relative_to(ROOT)}:{node.lineno} calls .{node.func.attr}()"
        for path in (ROOT / "pretrain" / "views").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ledger_writes()
    )
    assert not calls, "views/ must not change a campaign's ledger:\n" + "\n".join(calls)


def cycle_in(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, if it has one (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


@pytest.mark.parametrize("top", ["pretrain", "trainer"])
def test_the_wings_import_each_other_without_a_cycle(top):
    edges: dict[str, set[str]] = defaultdict(set)
    examples = {}
    for importer, module in imports_of(top):
        if module.split(".")[0] == top and wing(importer) != wing(module):
            edges[wing(importer)].add(wing(module))
            examples.setdefault((wing(importer), wing(module)), f"{importer} imports {module}")
    cycle = cycle_in(edges)
    assert cycle is None, (
        "a cycle between wings: "
        + " → ".join(cycle)
        + "\n"
        + "\n".join(examples[(a, b)] for a, b in zip(cycle, cycle[1:]))
    )


def test_no_import_cycle_between_modules():
    edges: dict[str, set[str]] = defaultdict(set)
    for top in PROJECT:
        for importer, module in imports_of(top):
            if module.split(".")[0] in PROJECT:
                edges[importer].add(module)
    cycle = cycle_in(edges)
    assert cycle is None, "an import cycle: " + " → ".join(cycle)


# the orchestrator's modules that need torch for what they do (they load or build models)
NEEDS_TORCH = {"pretrain.checkpoints.evaluation", "pretrain.checkpoints.export", "pretrain.checkpoints.registry"}


def test_the_orchestrator_imports_torch_only_where_it_loads_models():
    modules = sorted(
        module_name(p)
        for p in (ROOT / "pretrain").rglob("*.py")
        if p.name != "__main__.py" and module_name(p) not in NEEDS_TORCH
    )
    probe = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    importlib.import_module(name)\n"
        "    if 'torch' in sys.modules:\n"
        "        print(name); break\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, *modules], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "", f"importing {done.stdout.strip()} loads torch (only {sorted(NEEDS_TORCH)} may)"


def test_the_package_roots_hold_only_shared_modules_and_entry_points():
    def modules(folder: str) -> list[str]:
        return sorted(p.name for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py")

    assert len(modules("pretrain")) <= 8, modules("pretrain")
    assert len(modules("trainer")) <= 12, modules("trainer")
    assert modules("tests") == ["conftest.py"]


def test_torch_internals_say_when_torch_is_not_the_one_they_were_verified_with():
    from trainer.agent.torch_internals import VERIFIED_WITH, unverified_torch

    assert unverified_torch(f"{VERIFIED_WITH}.0+cpu") is None
    assert unverified_torch(f"{VERIFIED_WITH}.1") is None
    said = unverified_torch("9.1.0")
    assert said is not None and "torch 9.1.0" in said and "re-verify" in said
