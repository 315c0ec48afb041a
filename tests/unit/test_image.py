"""The Dockerfile (no Docker engine here: its essentials are read from the file, not built):
a base image argument, torch variant by build argument, every install under constraints.txt,
every package of the project copied in and nothing it needs dropped by .dockerignore, the node
agent importable, and a non-root user."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    rows = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(r.split(None, 1)[0].upper(), r.split(None, 1)[1] if " " in r else "") for r in rows]


def args_of(kind: str) -> list[str]:
    return [a for k, a in instructions() if k == kind]


def test_base_image_and_torch_variant_are_build_arguments():
    steps = instructions()
    first_from = next(i for i, (k, _) in enumerate(steps) if k == "FROM")
    base_args = [a.split("=")[0] for k, a in steps[:first_from] if k == "ARG"]
    assert steps[first_from][1].strip() in (f"${{{a}}}" for a in base_args), "FROM must name the base image by ARG"
    defaults = dict(a.split("=", 1) for a in args_of("ARG") if "=" in a)
    assert defaults["TORCH_VARIANT"] == "cpu" and "${TORCH_VARIANT}" in defaults["TORCH_INDEX"]


def test_every_pip_install_is_constrained():
    installs = [cmd for cmd in args_of("RUN") for cmd in cmd.split("&&") if "pip install" in cmd]
    assert installs and all("-c constraints.txt" in cmd for cmd in installs), installs
    copied = " ".join(args_of("COPY"))
    assert "constraints.txt" in copied


def test_every_package_is_copied_and_the_node_agent_imports():
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = {a.split()[0] for a in args_of("COPY")}
    for pattern in packages:
        assert pattern.rstrip("*") in copied, f"package {pattern} is not copied into the image"
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert not ignored & (copied | {"pyproject.toml", "README.md", "constraints.txt"}), ignored & copied
    assert any("import trainer.launch" in cmd for cmd in args_of("RUN"))


def test_runs_as_a_non_root_user():
    users = args_of("USER")
    assert users, "no USER: the image would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
