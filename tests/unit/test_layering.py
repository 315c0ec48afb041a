"""The layers hold: ``trainer/`` (pure torch, runs in workers and pods) imports nothing from the
layers above it, and ``pretrain/`` never imports Prefect. Read from the source (the AST), so an
import inside a function counts as much as one at the top of a module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize(
    "layer, forbidden",
    [
        ("trainer", {"pretrain", "flows", "tasks", "blocks", "deployments", "prefect", "mlflow"}),
        # pretrain/cli/app.py, the command line at the top, starts a campaign through deployments/
        ("pretrain", {"flows", "tasks", "blocks", "prefect"}),
    ],
)
def test_a_layer_imports_nothing_above_it(layer, forbidden):
    wrong = sorted(
        f"{path.relative_to(ROOT)} imports {module}"
        for path in (ROOT / layer).rglob("*.py")
        for module in imported_modules(path)
        if module.split(".")[0] in forbidden
    )
    assert not wrong, f"{layer}/ must not import {sorted(forbidden)}:\n" + "\n".join(wrong)
