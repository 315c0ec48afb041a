from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
from pydantic import BaseModel

from pretrain.spec.campaign import CampaignSpec, SpecError, parse_spec
from pretrain.spec.file import builtin_names, load_spec


def _types(annotation):
    """The annotation and every type nested in it (list[…], unions, Annotated[…])."""
    yield annotation
    for arg in get_args(annotation):
        yield from _types(arg)


def _models(model: type[BaseModel], seen=None):
    seen = seen if seen is not None else set()
    if model in seen:
        return
    seen.add(model)
    yield model
    for f in model.model_fields.values():
        for arg in _types(f.annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                yield from _models(arg, seen)


def test_every_field_is_documented():
    assert {"KillWorker", "SlowWorker", "CorruptCheckpoint"} <= {m.__name__ for m in _models(CampaignSpec)}
    for model in _models(CampaignSpec):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


@pytest.mark.parametrize("name", sorted(p.stem for p in Path(__file__).parents[2].joinpath("examples").glob("*.yaml")))
def test_every_example_spec_is_a_valid_builtin(name):
    """The examples/ a user reads are the specs the package ships (``builtin:<name>``)."""
    assert name in builtin_names()
    spec = load_spec(f"builtin:{name}")
    assert spec.name and spec.stages
    assert spec == load_spec(Path(__file__).parents[2] / "examples" / f"{name}.yaml")


def test_builtins_ship_in_the_pretrain_package_not_a_top_level_examples(tmp_path):
    """Another package called ``examples`` first on the path does not shadow the built-ins."""
    shadow = tmp_path / "examples"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("")
    (shadow / "tiny.yaml").write_text("name: not-the-builtin\n")
    code = "from pretrain.spec.file import load_spec; print(load_spec('builtin:tiny').name)"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "tiny"


def test_an_unknown_builtin_names_the_ones_there_are():
    with pytest.raises(
        SpecError,
        match="no built-in spec 'tinny'; the built-ins are builtin:drills, builtin:jsonl-corpus, "
        "builtin:three-stage, builtin:tiny",
    ):
        load_spec("builtin:tinny")


def test_builtin_demo_spec_is_valid():
    spec = load_spec("builtin:tiny")
    assert spec.cluster.workers_per_node == 2 and len(spec.stages) == 2
    assert spec.tracking.uri is None  # the default store: tests/unit/test_tracking_store.py


@pytest.mark.parametrize(
    "body, path, reason",
    [
        ({"stages": [{"name": "a", "steps": 0}]}, "stages.0.steps", "greater than 0"),
        ({"stages": [{"name": "a", "steps": 5, "lr": 1e-4, "min_lr": 1e-3}]}, "stages.0", "min_lr"),
        ({"model": {"d_model": 30, "n_head": 4}}, "model", "divisible"),
        ({"cluster": {"nodes_min": 3, "nodes_max": 2}}, "cluster", "nodes_min"),
        ({"cluster": {"spare_nodes": 1}}, "cluster", "nodes_max to 2 or more"),
        ({"cluster": {"nodes_max": 2, "node_timeout_s": 1}}, "cluster.node_timeout_s", "greater than or equal to 2"),
        (
            {"cluster": {"nodes_max": 2}, "chaos": [{"kind": "kill_node", "node": 2, "step": 3}]},
            "chaos.0.node",
            "has 2 node(s)",
        ),
        (
            {"model": {"max_seq_len": 32}, "stages": [{"name": "a", "steps": 5, "seq_len": 64}]},
            "(top level)",
            "max_seq_len",
        ),
        ({"checkpoint": {"intervall": 5}}, "checkpoint.intervall", "Extra inputs"),
        ({"stages": [{"name": "a", "steps": 5}, {"name": "a", "steps": 5}]}, "(top level)", "unique"),
    ],
)
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
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain.cli.app", "run", str(bad), "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "stages.0.steps" in proc.stderr and "bad.yaml" in proc.stderr
    assert not workdir.exists()


# ---- inputs that used to slip through (issue 10, item 8) ----------------------------------------
@pytest.mark.parametrize(
    "body, field, reason",
    [
        ({"name": ".."}, "name", "'.' or '..'"),
        ({"name": "."}, "name", "'.' or '..'"),
        ({"name": "a/b"}, "name", "pattern"),
        ({"workdir": "/tmp/{y}"}, "workdir", "{y}"),
        ({"workdir": "/tmp/{0}"}, "workdir", "{0}"),
        ({"workdir": "/tmp/{name"}, "workdir", "'{name}'"),
        ({"stages": [{"name": "a", "steps": 100_000_000}]}, "stages.0.steps", "less than"),
        ({"stages": [{"name": "a", "steps": True}]}, "stages.0.steps", "not a boolean"),
        ({"seed": False}, "seed", "not a boolean"),
        ({"stages": [{"name": "a", "steps": 5, "lr": True}]}, "stages.0.lr", "not a boolean"),
        (
            {"skip_samples": [{"stage": "main", "start": 10, "end": 5}]},
            "skip_samples.0",
            "end (5) must be greater than start (10)",
        ),
        ({"skip_samples": [{"stage": "main", "start": 5, "end": 5}]}, "skip_samples.0", "greater than start"),
        ({"chaos": [{"kind": "kill_worker", "rank": 2}]}, "chaos.0.rank", "2 workers"),
        ({"chaos": [{"kind": "kill_node", "node": 1}]}, "chaos.0.node", "1 node"),
        # each drill kind has only its own fields: one of another kind is refused, named
        ({"chaos": [{"kind": "kill_worker", "factor": 3}]}, "chaos.0.kill_worker.factor", "Extra inputs"),
        ({"chaos": [{"kind": "kill_node", "rank": 1}]}, "chaos.0.kill_node.rank", "Extra inputs"),
        ({"chaos": [{"kind": "kill_saver", "delay_s": 1}]}, "chaos.0.kill_saver.delay_s", "Extra inputs"),
        ({"chaos": [{"kind": "slow_worker", "node": 0}]}, "chaos.0.slow_worker.node", "Extra inputs"),
        (
            {"chaos": [{"kind": "corrupt_checkpoint", "step": 4, "rank": 0}]},
            "chaos.0.corrupt_checkpoint.rank",
            "Extra inputs",
        ),
        ({"chaos": [{"kind": "loss_spike", "factor": 1}]}, "chaos.0.loss_spike.factor", "greater than 1"),
        ({"chaos": [{"kind": "kill_wrker"}]}, "chaos.0", "`kind` must be one of kill_worker, hang_worker"),
        ({"chaos": [{"step": 3}]}, "chaos.0", "`kind` must be one of"),
        ({"checkpoint": {"uri": "s3://AKIAXXX:S3cr3tV4lue@bucket/ckpt"}}, "checkpoint.uri", "AWS_ACCESS_KEY_ID"),
        (
            {"checkpoint": {"uri": "s3://bucket/ckpt", "s3_endpoint_url": "http://u:S3cr3tV4lue@127.0.0.1:9000"}},
            "checkpoint.s3_endpoint_url",
            "s3-campaign-storage",
        ),
        (
            {"tracking": {"uri": "https://user:S3cr3tV4lue@mlflow.example.com"}},
            "tracking.uri",
            "MLFLOW_TRACKING_USERNAME",
        ),
        (
            {"tracking": {"uri": "https://mlflow.example.com/?token=S3cr3tV4lue"}},
            "tracking.uri",
            "mlflow-tracking block",
        ),
    ],
)
def test_more_invalid_values_name_the_field(body, field, reason):
    with pytest.raises(SpecError) as err:
        parse_spec(body, "x.yaml")
    assert f"  {field}:" in str(err.value) and reason in str(err.value), str(err.value)
    assert "S3cr3tV4lue" not in str(err.value)  # the error message does not repeat a secret


@pytest.mark.parametrize(
    "body, line",
    [
        ({"model": {"n_layers": 2}}, "model.n_layers: Extra inputs are not permitted (did you mean 'n_layer'?)"),
        (
            {"stages": [{"name": "a", "step": 5}]},
            "stages.0.step: Extra inputs are not permitted (did you mean 'steps'?)",
        ),
        (
            {"cluster": {"worker_per_node": 2}},
            "cluster.worker_per_node: Extra inputs are not permitted (did you mean 'workers_per_node'?)",
        ),
        (
            {"chaos": [{"kind": "kill_worker", "stepp": 3}]},
            "chaos.0.kill_worker.stepp: Extra inputs are not permitted (did you mean 'step'?)",
        ),
        ({"trackin": {}}, "trackin: Extra inputs are not permitted (did you mean 'tracking'?)"),
        (
            {"checkpoint": {"intervall": 5}},
            "checkpoint.intervall: Extra inputs are not permitted (did you mean 'interval'?)",
        ),
        # nothing close: no guess
        ({"model": {"colour": "red"}}, "model.colour: Extra inputs are not permitted\n"),
        ({"chaos": [{"kind": "kill_node", "rank": 1}]}, "chaos.0.kill_node.rank: Extra inputs are not permitted\n"),
    ],
)
def test_a_misspelt_field_is_named_with_the_field_it_is_close_to(body, line):
    with pytest.raises(SpecError) as err:
        parse_spec(body, "x.yaml")
    assert f"  {line}" in str(err.value), str(err.value)


def test_chaos_rank_is_checked_against_the_block_cluster_only_after_resolution():
    # a cluster block may give more workers than the inline default: judged once it is resolved
    parse_spec({"chaos": [{"kind": "kill_worker", "rank": 5}], "blocks": {"cluster": "local-process-cluster/big"}})
    parse_spec({"cluster": {"workers_per_node": 3, "nodes_max": 2}, "chaos": [{"kind": "kill_worker", "rank": 5}]})
    # a standby node may be the drill's: it trains once it took a lost node's place
    parse_spec({"cluster": {"nodes_max": 2, "spare_nodes": 1}, "chaos": [{"kind": "kill_node", "node": 2, "step": 3}]})


def test_sqlite_paths_with_at_signs_are_not_credentials(tmp_path):
    spec = parse_spec({"tracking": {"uri": "sqlite:////tmp/team@lab/mlflow.db"}})
    assert spec.tracking.uri == "sqlite:////tmp/team@lab/mlflow.db"


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"", "is empty"),
        (b"# only a comment\n", "is empty"),
        (b"name: caf\xe9\n", "not UTF-8"),
        (b"name: a\nseed: 1\nname: b\n", "duplicate key 'name'"),
        (b"stages:\n  - name: a\n    steps: 5\n    steps: 6\n", "duplicate key 'steps'"),
        (b"- a\n- b\n", "must be a mapping"),
    ],
)
def test_unreadable_spec_files_name_the_file_and_reason(tmp_path, content, reason):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert str(path) in str(err.value) and reason in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "content, what",
    [
        (b"", "is empty"),
        (b"name: ..\n", "name"),
        (b"workdir: '{y}'\n", "workdir"),
        (b"name: a\nname: b\n", "duplicate key"),
        (b"\xff\xfe", "not UTF-8"),
        (b"stages: [{name: a, steps: true}]\n", "stages.0.steps"),
    ],
)
def test_cli_refuses_bad_specs_without_traceback_or_writes(tmp_path, content, what):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(content)
    workdir = tmp_path / "wd"
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain.cli.app", "run", str(bad), "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert what in proc.stderr and "bad.yaml" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]  # no workdir, no runs/ beside it
