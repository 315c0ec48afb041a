"""Reading a campaign spec from a YAML file (or a built-in example): the file's own problems
(missing, not UTF-8, not YAML, duplicate keys, empty) fail as a :class:`SpecError` naming the file.
"""

from __future__ import annotations

import io
from importlib import resources
from pathlib import Path

import yaml

from pretrain.spec.campaign import CampaignSpec, SpecError, parse_spec

BUILTIN_PREFIX = "builtin:"


def _builtin_dir():
    """Where the built-in specs ship: package data of ``pretrain`` (also when installed from a
    wheel, and whatever else on the path is called ``examples``)."""
    return resources.files("pretrain") / "builtin"


def builtin_names() -> list[str]:
    """Names of the built-in specs (``builtin:<name>``)."""
    return sorted(p.name.removesuffix(".yaml") for p in _builtin_dir().iterdir() if p.name.endswith(".yaml"))


def builtin_spec_path(name: str) -> Path:
    path = Path(str(_builtin_dir() / f"{name}.yaml"))
    if not path.is_file():
        raise SpecError(
            f"no built-in spec {name!r}; the built-ins are "
            + ", ".join(f"{BUILTIN_PREFIX}{n}" for n in builtin_names())
        )
    return path


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error (YAML would
    silently keep the last one, so a typo'd override would win unnoticed)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r} (first on line {seen[key] + 1}); keep only one",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_spec(path: str | Path) -> CampaignSpec:
    """Read a spec from a YAML file (or 'builtin:<name>'), failing with a clear SpecError."""
    text_path = str(path)
    p = builtin_spec_path(text_path[len(BUILTIN_PREFIX) :]) if text_path.startswith(BUILTIN_PREFIX) else Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as err:
        raise SpecError(f"cannot read campaign spec {p}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise SpecError(
            f"campaign spec {p} is not UTF-8 text (byte {err.start}: {err.reason}); save it as UTF-8"
        ) from None
    try:
        stream = io.StringIO(text)
        stream.name = str(p)  # YAML's messages name the file
        data = yaml.load(stream, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise SpecError(f"campaign spec {p} is not valid YAML: {err}") from None
    if data is None:
        raise SpecError(
            f"campaign spec {p} is empty: give at least the campaign's name and stages "
            f"(`pretrain spec-schema` lists every field; `{BUILTIN_PREFIX}tiny` is the demo)"
        )
    return parse_spec(data, str(p))


def resolve_spec(
    spec: CampaignSpec | None = None, spec_path: str | None = None, workdir: str | Path | None = None
) -> CampaignSpec:
    """The spec a flow was given: inline, else from ``spec_path``, else the built-in demo;
    ``workdir`` overrides where the campaign keeps its state."""
    if spec is None:
        spec = load_spec(spec_path or f"{BUILTIN_PREFIX}tiny")
    return spec.with_workdir(workdir)
