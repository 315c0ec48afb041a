"""The documentation's references to the tests that prove a behaviour (docs/fault-tolerance.md
names one or more for every failure it lists) stay true as tests are renamed or moved."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = re.compile(r"\b(test_[a-z0-9_]+)::(test_[a-z0-9_]+)\b")


def test_every_test_the_docs_name_exists_in_the_file_they_name():
    named = {
        (m[1], m[2], doc.relative_to(ROOT).as_posix())
        for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        for m in REFERENCE.finditer(doc.read_text(encoding="utf-8"))
    }
    assert len(named) > 50  # docs/fault-tolerance.md alone names dozens
    defined: dict[str, set[str]] = {}
    for module in {m for m, _, _ in named}:
        path = next((ROOT / "tests").glob(f"*/{module}.py"), None)  # tests/unit/ or tests/scenarios/
        tree = ast.parse(path.read_text(encoding="utf-8")) if path else ast.Module(body=[], type_ignores=[])
        defined[module] = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    missing = sorted(f"{doc}: {module}::{name}" for module, name, doc in named if name not in defined[module])
    assert not missing, "renamed or moved tests still named in the docs:\n" + "\n".join(missing)
