"""What a person sees of data preparation: ``pretrain data prepare`` / ``inspect``, the flow's
Prefect progress artifact and the data set as an MLflow dataset input. The progress display itself:
``test_data_progress.py``."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from rich.console import Console

from pretrain.cli.data import show_on
from pretrain.console_progress import LineProgress, human
from pretrain.data.inspection import InspectError, inspect_data_set, open_data_set
from pretrain.data.prepare.pipeline import prepare
from pretrain.data.prepare.progress import PrepProgress
from pretrain.spec.data import DataSpec
from pretrain.state.ledger import Ledger
from pretrain.tracking.runs import Tracker
from support import s3_servers
from support.campaigns import DATA, pretrain_cli, session_api_env, small_spec, wait_for
from support.s3_servers import BUCKET
from trainer.storage import open_storage

seaweed, aws_env = s3_servers.seaweed, s3_servers.aws_env


# ---- pretrain data inspect ------------------------------------------------------------------
@pytest.fixture
def data_copy(prepared_data, tmp_path) -> Path:
    dest = tmp_path / "ds"
    shutil.copytree(prepared_data, dest)
    return dest


def test_inspect_prints_stats_and_decodes_windows(data_copy):
    manifest = json.loads((data_copy / "manifest.json").read_text())
    proc = pretrain_cli("data", "inspect", str(data_copy), "--windows", "2", "--tokens", "16")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"fingerprint {manifest['fingerprint']}" in out and f"vocab {manifest['vocab_size']}" in out
    assert f"{manifest['tokens']['train']:,}" in out and f"{manifest['tokens']['val']:,}" in out
    assert out.count("@ token") == 2 and "train_00000.bin" in out


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda d: (d / "manifest.json").write_text("{not json"), "manifest.json is damaged"),
        (lambda d: (d / "manifest.json").write_text('{"a": 1}'), "manifest.json is damaged (not a data manifest"),
        (lambda d: (d / "train_00000.bin").unlink(), "train_00000.bin is missing"),
        (lambda d: (d / "train_00000.bin").write_bytes(b"\0\0"), "train_00000.bin has 2 bytes"),
        (lambda d: (d / "tokenizer.json").write_text("[]"), "tokenizer.json is damaged"),
        (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json is missing"),
    ],
)
def test_inspect_names_the_damaged_file_and_what_to_do(data_copy, damage, says):
    damage(data_copy)
    with pytest.raises(InspectError, match="prepare") as e:
        inspect_data_set(str(data_copy), Console(file=io.StringIO()))
    assert says in str(e.value) and str(data_copy) in str(e.value)


def test_the_cli_reports_a_damaged_data_set_in_one_line_exit_2(data_copy):
    (data_copy / "manifest.json").write_text("{not json")
    proc = pretrain_cli("data", "inspect", str(data_copy))
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: {data_copy / 'manifest.json'} is damaged") and "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def jsonl_data_set(tmp_path_factory):
    """(manifest, progress lines) of a v2 data set prepared from JSONL with a repeated document and a
    broken line (skipped), its progress shown on a display as ``pretrain data prepare`` shows it."""
    root = tmp_path_factory.mktemp("jsonl")
    texts = [f"def f{i}(x):\n    return x * {i} + json.dumps(x)\n" * 3 for i in range(40)]
    (root / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:20]) + "not json\n")
    (root / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[19:]))  # texts[19] twice
    data = DataSpec.model_validate(
        {
            "sources": [str(root / "*.jsonl")],
            "tokenizer": {"vocab_size": 300},
            "val_fraction": 0.1,
            "unit_bytes": 4096,
            "workers": 1,
            "on_bad_record": "skip",
        }
    )
    lines: list[str] = []
    display = LineProgress("data", lines.append, unit="B", rated=("tokens",), interval_s=0)
    manifest = prepare(data, root / "data", work=root / "work", log=lambda *_: None, progress=show_on(display))
    display.close()
    return manifest, lines


def test_preparation_progress_reads_as_lines_per_phase_ending_with_the_totals(jsonl_data_set):
    manifest, lines = jsonl_data_set
    phases = [line.split(" ")[1] for line in lines]
    assert phases[:2] == ["scan", "tokenizer"] and phases[-1] == "done"
    assert "tokenize" in phases and phases.index("tokenize") < phases.index("assemble")
    tokens = sum(manifest["tokens"].values())
    assert lines[-1].startswith("data: done 100% ") and f"tokens {human(tokens)}" in lines[-1]


def test_inspect_shows_sources_skips_and_duplicates_of_a_v2_data_set(jsonl_data_set):
    manifest, _ = jsonl_data_set
    out = io.StringIO()
    inspect_data_set(manifest["location"], Console(file=out, width=250), windows=1, window_tokens=8)
    text = out.getvalue()
    assert f"fingerprint {manifest['fingerprint']}" in text and "manifest v2" in text
    assert "a.jsonl" in text and "b.jsonl" in text and "bad_record 1" in text and "duplicate 1" in text
    assert f"sha256 {manifest['tokenizer_sha256'][:16]}" in text and text.count("@ token") == 1


def test_inspect_reads_a_data_set_on_s3_by_ranges_with_credentials_from_the_environment(
    jsonl_data_set, seaweed, aws_env
):
    manifest, _ = jsonl_data_set
    options = {"endpoint_url": seaweed.endpoint, "region": "us-east-1"}  # what --s3-endpoint-url/--s3-region give
    location = f"s3://{BUCKET}/ux-inspect/{manifest['fingerprint']}"
    remote = open_storage(location, **options)
    for path in Path(manifest["location"]).iterdir():
        remote.put_file(path.name, path)
    local, on_s3 = io.StringIO(), io.StringIO()
    inspect_data_set(manifest["location"], Console(file=local, width=250), windows=2, window_tokens=8, seed=3)
    inspect_data_set(location, Console(file=on_s3, width=250), windows=2, window_tokens=8, seed=3, s3_options=options)
    assert on_s3.getvalue().replace(location, "X") == local.getvalue().replace(manifest["location"], "X")
    with pytest.raises(InspectError, match=f"no data set at s3://{BUCKET}/ux-inspect/nothing"):
        open_data_set(f"s3://{BUCKET}/ux-inspect/nothing", options)


def test_inspect_of_a_missing_path_or_a_data_root_says_what_to_give(data_copy, tmp_path):
    with pytest.raises(InspectError, match="does not exist: give a prepared data set's directory"):
        open_data_set(str(tmp_path / "nowhere"))
    root = tmp_path / "data"
    (root / ".work" / "units").mkdir(parents=True)  # preparation's own files are no data set
    shutil.copytree(data_copy, root / "abc123")
    assert open_data_set(str(root)).location == str(root / "abc123")  # the only one: that one
    data_copy.rename(root / "def456")
    with pytest.raises(InspectError, match=f"it holds these data sets: {root / 'abc123'}, {root / 'def456'}; give one"):
        open_data_set(str(root))


# ---- the flow: Prefect progress artifact, MLflow dataset input ------------------------------
def test_the_flow_publishes_progress_and_logs_the_data_set_to_the_campaign_run_once(prefect_harness, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.prepare_data import prepare_data
    from tasks.artifacts import artifact_key

    spec = small_spec(tmp_path / "wd")
    ledger = Ledger.open(spec)
    tracker = Tracker(spec.tracking_uri, spec.tracking.experiment, spec.layout.mlflow_artifacts)
    run_id = tracker.campaign_run(ledger.record.campaign_id, spec.name, spec.spec_hash(), {})
    ledger.set_parent_run(run_id)
    seen: list[PrepProgress] = []
    summary = prepare_data(spec=spec, progress=seen.append)
    prepare_data(spec=spec)  # again: the data set is reused, and logged once
    assert seen and seen[-1].phase == "done"
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key("data-preparation", spec.name)]))
        )
    assert found and all(a.data == 100.0 for a in found) and "**done**" in found[0].description
    inputs = MlflowClient(spec.tracking_uri).get_run(run_id).inputs.dataset_inputs
    assert len(inputs) == 1
    dataset = inputs[0].dataset
    assert dataset.digest == summary["fingerprint"] and dataset.name == f"{spec.name}-data"
    assert json.loads(dataset.profile)["tokens"] == summary["tokens"]


def test_a_refused_progress_artifact_is_said_once_and_preparation_goes_on(prefect_harness):
    from tasks.data_progress import PrepArtifact

    said: list[str] = []
    artifact = PrepArtifact("Not A Valid Key!", said.append, min_interval_s=0)  # Prefect refuses this key
    for phase in ("scan", "tokenizer", "tokenize", "done"):
        artifact(PrepProgress(phase))  # never raises
    assert len(said) == 1 and "preparation goes on" in said[0] and artifact.artifact_id is None


def test_an_mlflow_refusal_never_fails_data_preparation(prefect_harness, tmp_path):
    from flows.prepare_data import prepare_data

    spec = small_spec(tmp_path / "wd")
    Ledger.open(spec).set_parent_run("0" * 32)  # a run MLflow does not have: refused, not retried
    summary = prepare_data(spec=spec)
    assert summary["tokens"]["train"] > 0
    assert Ledger.open(spec).record.data is not None


# ---- pretrain data prepare ------------------------------------------------------------------
def data_cli(*args: str) -> subprocess.CompletedProcess:
    """``pretrain data ...`` in a fresh process on the session's Prefect server (no server of its own)."""
    return subprocess.run(
        [sys.executable, "-m", "pretrain.cli.app", "data", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=session_api_env(),
    )


def write_spec(tmp_path: Path, data: dict) -> str:
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(
        yaml.safe_dump(
            {"name": "ux", "workdir": str(tmp_path / "wd"), "data": data, "stages": [{"name": "s", "steps": 2}]}
        )
    )
    return str(spec_file)


def jsonl_corpus(tmp_path: Path, *, files: int, records: int, field: str, repeat: int) -> Path:
    """``files`` JSONL files of ``records`` distinct small Python-like documents in ``field``."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for k in range(files):
        (corpus / f"part{k}.jsonl").write_text(
            "".join(
                json.dumps({field: f"def f{k}_{i}(x):\n    return x * {i} + {k}\n" * repeat}) + "\n"
                for i in range(records)
            )
        )
    return corpus


def test_cli_prepare_shows_progress_lines_off_a_terminal_and_ends_with_the_stats(prefect_harness, tmp_path):
    corpus = jsonl_corpus(tmp_path, files=2, records=30, field="content", repeat=4)
    data = {
        "sources": [{"path": str(corpus / "*.jsonl"), "text_field": "content"}],
        "tokenizer": {"vocab_size": 300},
        "val_fraction": 0.1,
        "unit_bytes": 4096,
        "workers": 1,
    }
    result = data_cli("prepare", write_spec(tmp_path, data), "--interval", "0")
    assert result.returncode == 0, result.stderr
    assert "data: done" in result.stderr and "\x1b[" not in result.stderr  # progress lines on stderr, not a bar
    manifest = open_data_set(str(tmp_path / "wd" / "data")).manifest  # the one data set it made
    assert f"fingerprint {manifest['fingerprint']}" in result.stdout
    assert f"{manifest['tokens']['train']:,}" in result.stdout and f"{manifest['tokens']['val']:,}" in result.stdout


@pytest.mark.parametrize(
    "case, says",
    [
        ("no such source", "error: data.sources[0]"),
        ("the workdir of another campaign", "error: "),
    ],
)
def test_cli_prepare_refuses_wrong_input_in_one_line_exit_2(prefect_harness, tmp_path, case, says):
    if case == "no such source":
        spec_file = write_spec(tmp_path, {"sources": [str(tmp_path / "none" / "*.jsonl")]})
        also = "matched no files"
    else:
        Ledger.open(small_spec(tmp_path / "wd")).save()  # the workdir holds campaign "t"
        spec_file = write_spec(tmp_path, DATA)  # campaign "ux", same workdir
        also = "holds campaign 't'"
    result = data_cli("prepare", spec_file)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(says) and also in last
    assert "Traceback" not in result.stderr + result.stdout


def test_ctrl_c_stops_cli_prepare_in_one_line_exit_130_and_the_same_command_resumes(prefect_harness, tmp_path):
    corpus = jsonl_corpus(tmp_path, files=4, records=200, field="text", repeat=40)
    spec_file = write_spec(
        tmp_path,
        {"sources": [str(corpus / "*.jsonl")], "tokenizer": {"vocab_size": 300}, "unit_bytes": 4096, "workers": 1},
    )

    proc = subprocess.Popen(
        [sys.executable, "-m", "pretrain.cli.app", "data", "prepare", spec_file],
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env=session_api_env(),
    )
    units = tmp_path / "wd" / "data" / ".work" / "units"
    try:
        wait_for(
            lambda: (
                proc.poll() is not None or (units.is_dir() and any(not d.name.startswith(".") for d in units.iterdir()))
            ),
            120,
            "a finished work unit",
        )
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends: the whole process group
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted: finished work units are kept; run the same command to resume"
    assert "Traceback" not in err + out
    again = data_cli("prepare", spec_file)
    assert again.returncode == 0 and "finished earlier are reused" in again.stderr
