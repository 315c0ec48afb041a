from __future__ import annotations

import subprocess
import sys

from pathlib import Path

import pytest
from pydantic import BaseModel

from pretrain.spec import CampaignSpec, SpecError, load_spec, parse_spec


def _models(model: type[BaseModel], seen=None):
    seen = seen if seen is not None else set()
    if model in seen:
        return
    seen.add(model)
    yield model
    for f in model.model_fields.values():
        for arg in [f.annotation, *getattr(f.annotation, "__args__", ())]:
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                yield from _models(arg, seen)


def test_every_field_is_documented():
    for model in _models(CampaignSpec):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


@pytest.mark.parametrize("name", sorted(p.stem for p in Path(__file__).parents[1].joinpath("examples").glob("*.yaml")))
def test_every_shipped_example_spec_is_valid(name):
    spec = load_spec(f"builtin:{name}")
    assert spec.name and spec.stages


def test_builtin_demo_spec_is_valid():
    spec = load_spec("builtin:tiny")
    assert spec.cluster.workers_per_node == 2 and len(spec.stages) == 2
    assert spec.tracking_uri == f"sqlite:///{spec.workdir_path / 'mlflow.db'}"


@pytest.mark.parametrize("body, path, reason", [
    ({"stages": [{"name": "a", "steps": 0}]}, "stages.0.steps", "greater than 0"),
    ({"stages": [{"name": "a", "steps": 5, "lr": 1e-4, "min_lr": 1e-3}]}, "stages.0", "min_lr"),
    ({"model": {"d_model": 30, "n_head": 4}}, "model", "divisible"),
    ({"cluster": {"nodes_min": 3, "nodes_max": 2}}, "cluster", "nodes_min"),
    ({"model": {"max_seq_len": 32}, "stages": [{"name": "a", "steps": 5, "seq_len": 64}]}, "(top level)", "max_seq_len"),
    ({"checkpoint": {"intervall": 5}}, "checkpoint.intervall", "Extra inputs"),
    ({"stages": [{"name": "a", "steps": 5}, {"name": "a", "steps": 5}]}, "(top level)", "unique"),
])
def test_invalid_values_name_the_field_and_reason(body, path, reason):
    with pytest.raises(SpecError) as err:
        parse_spec(body, "x.yaml")
    assert f"  {path}:" in str(err.value) and reason in str(err.value) and "x.yaml" in str(err.value)


def test_invalid_yaml_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="bad.yaml is not valid YAML"):
        load_spec(bad)
    with pytest.raises(SpecError, match="cannot read campaign spec"):
        load_spec(tmp_path / "missing.yaml")


def test_workdir_override_does_not_change_the_spec_hash(tmp_path):
    spec = CampaignSpec()
    assert spec.with_workdir(tmp_path).workdir_path == tmp_path.resolve()
    assert spec.with_workdir(tmp_path).spec_hash() == spec.spec_hash()
    assert spec.model_copy(update={"seed": 1}).spec_hash() != spec.spec_hash()


def test_cli_rejects_a_bad_spec_before_anything_runs(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages:\n  - {name: x, steps: -1}\n")
    workdir = tmp_path / "wd"
    proc = subprocess.run([sys.executable, "-m", "pretrain.cli", "run", str(bad), "--workdir", str(workdir)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "stages.0.steps" in proc.stderr and "bad.yaml" in proc.stderr
    assert not workdir.exists()
