"""`pretrain compare`: two short campaigns with different learning rates, run from one directory
(so they share its mlflow.db), compared from MLflow — the sqlite store and a real `mlflow server`
on it — by workdir, run id and name; as a table, JSON, a PNG and a Prefect artifact."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from flows.campaign import pretrain_campaign
from flows.compare import ARTIFACT_KEY, compare_campaigns
from pretrain.cli.app import app
from pretrain.state.ledger import Ledger
from pretrain.tracking.runs import Tracker
from pretrain.views.compare import CompareError, compare
from pretrain.views.compare_table import differing_params, markdown
from pretrain.views.status import campaign_status
from support.campaigns import _tracking_template, pretrain_cli, seed_data, small_spec
from support.mlflow_server import MlflowServer
from support.s3_servers import free_ports
from trainer.job.reporting import read_all

LRS = {"lr-high": 3e-3, "lr-low": 1e-3}
STEPS, WORKERS, MICRO, SEQ = 4, 2, 4, 32  # one stage: tokens over stages are tests/unit/test_tracking_store.py's
TOKENS = STEPS * WORKERS * MICRO * SEQ


@pytest.fixture(scope="module")
def pair(prefect_harness, prepared_data, tmp_path_factory):
    """Both campaigns, run from one directory with no tracking settings: they share its mlflow.db."""
    here = tmp_path_factory.mktemp("runs-here")
    shutil.copyfile(_tracking_template(prepared_data), here / "mlflow.db")  # migrated already: saves seconds
    specs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.chdir(here)
        for name, lr in LRS.items():
            spec = small_spec(
                here / name,
                name=name,
                stages=[
                    {"name": "main", "steps": STEPS, "seq_len": SEQ, "micro_batch": MICRO, "warmup_steps": 1, "lr": lr}
                ],
            )
            seed_data(spec, prepared_data, own_store=False)
            assert pretrain_campaign(spec=spec)["status"] == "completed"
            specs[name] = spec
    return here, specs


def test_campaigns_run_from_one_directory_share_its_store(pair):
    here, specs = pair
    for spec in specs.values():
        assert Ledger.read(spec.layout).record.mlflow.tracking_uri == f"sqlite:///{here}/mlflow.db"
        assert not (spec.workdir_path / "mlflow.db").exists()
    client = MlflowClient(f"sqlite:///{here}/mlflow.db")
    exp = client.get_experiment_by_name("pretrain")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`pretrain.role` = 'campaign'")
    assert sorted(r.data.tags["pretrain.campaign"] for r in runs) == sorted(LRS)


def expected(spec) -> dict:
    """The numbers as the campaign's ledger and its jobs' own files have them."""
    record = Ledger.read(spec.layout).record
    evals = [record.stages[s.name].eval["val_loss"] for s in spec.stages]
    jobs = spec.layout.root / "jobs"
    stall = sum(r.get("ckpt_block_s", 0.0) for path in jobs.glob("*/*/metrics.jsonl") for r in read_all(path))
    return {
        "tokens_seen": TOKENS,
        "final_eval_loss": evals[-1],
        "best_eval_loss": min(evals),
        "restarts": 0,
        "rollbacks": 0,
        "checkpoint_stall_s": pytest.approx(stall),
        "status": "FINISHED",
    }


def test_compare_reads_the_right_numbers_from_the_shared_sqlite_store(pair):
    here, specs = pair
    summaries = compare(
        [str(s.workdir_path) for s in specs.values()], "sqlite:///nowhere.db"
    )  # each ledger names its store
    for summary, spec in zip(summaries, specs.values()):
        assert summary.campaign == spec.name
        assert {k: getattr(summary, k) for k in expected(spec)} == expected(spec)
        record = Ledger.read(spec.layout).record
        assert summary.run_id == record.mlflow.parent_run_id  # this campaign's run, not the other's
        reckoned = campaign_status(spec.workdir_path)["goodput"]  # the ledger's reckoning, now
        # the goodput and wall time the campaign logged to its run at its end, while its span was still
        # open (the report's pictures and the run's end came after: seconds on a loaded machine, so the
        # ledger's later wall is longer by an amount no ratio bounds); the productive time is the same
        run = MlflowClient(f"sqlite:///{here}/mlflow.db").get_run(summary.run_id)
        productive = reckoned["parts_s"]["productive"]
        assert productive < summary.wall_time_s == run.data.metrics["goodput_wall_s"] <= reckoned["wall_s"]
        assert 0 < summary.goodput == run.data.metrics["goodput"] < 1
        # the same split: the logged goodput is rounded to 4 places, the seconds to 3 (a test campaign's
        # productive time is ~40 ms, so its rounding alone moves productive / wall by up to ~1.3 %)
        rounding = 5e-4 * (1 + summary.goodput) + 5e-5 * summary.wall_time_s + 1e-9
        assert abs(summary.goodput * summary.wall_time_s - productive) <= rounding
        assert summary.goodput >= reckoned["goodput"]
        assert summary.eval_curve == [(TOKENS, summary.final_eval_loss)]
    assert differing_params(summaries) == ["main.lr"]  # the only difference (names and workdirs aside)
    assert [s.params["main.lr"] for s in summaries] == [str(lr) for lr in LRS.values()]
    assert summaries[0].final_eval_loss != summaries[1].final_eval_loss


def test_compare_through_a_real_mlflow_server_by_run_id_and_name(pair, tmp_path):
    here, specs = pair
    local = {s.campaign: s for s in compare([str(s.workdir_path) for s in specs.values()], "")}
    high_run = local["lr-high"].run_id
    MlflowClient(f"sqlite:///{here}/mlflow.db").log_metric(
        high_run, "goodput", 0.75, step=1
    )  # a later value than the campaign's
    server = MlflowServer(here).start()  # serves the campaigns' store
    try:
        served = compare([high_run, "lr-low"], server.uri)
        with pytest.raises(CompareError, match="no campaign of that name"):
            compare(["lr-medium"], server.uri)
    finally:
        server.stop()
    assert [s.campaign for s in served] == ["lr-high", "lr-low"]
    assert served[0].goodput == 0.75 and served[1].goodput == local["lr-low"].goodput > 0
    for s in served:
        mine = local[s.campaign]
        keys = (
            "tokens_seen",
            "final_eval_loss",
            "best_eval_loss",
            "restarts",
            "rollbacks",
            "checkpoint_stall_s",
            "params",
            "eval_curve",
            "status",
        )
        assert {k: getattr(s, k) for k in keys} == {k: getattr(mine, k) for k in keys}
    assert f"| goodput | 75.0% | {served[1].goodput:.1%} |" in markdown(served)
    assert "| goodput | 75.0% | — |" in markdown([served[0], replace(served[1], goodput=None)])  # not logged: "—"


def test_cli_prints_the_table_json_and_a_png(pair, tmp_path):
    here, specs = pair
    workdirs = [str(s.workdir_path) for s in specs.values()]
    runner = CliRunner()
    shown = runner.invoke(app, ["compare", *workdirs])
    assert shown.exit_code == 0, shown.output
    for text in ("tokens seen", f"{TOKENS:,}", "final eval loss", "param main.lr", "0.003", "0.001", "rollbacks"):
        assert text in shown.output
    png = tmp_path / "eval.png"
    as_json = runner.invoke(app, ["compare", *workdirs, "--json", "--png", str(png)])
    assert as_json.exit_code == 0, as_json.output
    rows = json.loads(as_json.stdout)
    assert [r["campaign"] for r in rows] == list(LRS) and rows[0]["tokens_seen"] == TOKENS
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert runner.invoke(app, ["compare", *workdirs, "--png", str(png)]).exit_code == 0  # ours: replaced
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text("name: mine\n")
    for typo, says in ((spec_file, "ending in .png"), (spec_file.with_suffix(".png"), "is not a PNG")):
        if typo.suffix == ".png":
            typo.write_text("name: mine\n")
        refused = runner.invoke(app, ["compare", *workdirs, "--png", str(typo)])
        assert refused.exit_code == 2 and says in refused.output and typo.read_text() == "name: mine\n", refused.output
    copy = tmp_path / "copy"
    shutil.copytree(workdirs[0], copy)
    twice = runner.invoke(app, ["compare", workdirs[0], str(copy), workdirs[1]])
    assert twice.exit_code == 0 and f"{workdirs[0]} and {copy} are the same campaign (MLflow run" in twice.output
    [note] = [line for line in twice.output.splitlines() if line.startswith("note:")]
    assert workdirs[1] not in note  # the other one is not
    missing = runner.invoke(app, ["compare", str(tmp_path), "--tracking-uri", f"sqlite:///{pair[0]}/mlflow.db"])
    assert missing.exit_code == 2 and "holds no campaign" in missing.output and "Traceback" not in missing.output


def test_compare_campaigns_flow_publishes_the_table(pair):
    from prefect.artifacts import Artifact

    here, specs = pair
    rows = compare_campaigns([str(s.workdir_path) for s in specs.values()])
    assert [r["campaign"] for r in rows] == list(LRS)
    artifact = Artifact.get(ARTIFACT_KEY)
    assert "param main.lr" in artifact.data and "tokens seen" in artifact.data


def test_an_mlflow_server_that_is_away_is_one_line_saying_so(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    away = f"http://127.0.0.1:{free_ports(1)[0]}"
    with pytest.raises(
        CompareError, match=f"lr-high: MLflow at {away} cannot be reached.*start it, or give the right --tracking-uri"
    ):
        compare(["lr-high"], away)


def test_the_command_gives_up_on_an_mlflow_that_is_away_in_seconds_not_minutes():
    away = f"http://127.0.0.1:{free_ports(1)[0]}"
    proc = pretrain_cli("compare", "lr-high", "--tracking-uri", away, timeout=90)  # MLflow's own default: ~4 min
    assert proc.returncode == 2 and "cannot be reached" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_what_cannot_be_compared_says_why_and_what_to_do(prepared_data, tmp_path):
    store = tmp_path / "elsewhere" / "mlflow.db"
    store.parent.mkdir()
    with pytest.raises(CompareError, match="no MLflow store at .*give their store with --tracking-uri"):
        compare(["lr-high"], f"sqlite:///{store}")
    assert not store.exists()  # not created by looking
    garbage = tmp_path / "mlflow.db"  # damaged, or some other file under that name
    garbage.write_bytes(b"\x00garbage, not sqlite" * 200)
    with pytest.raises(CompareError, match="store at .* cannot be read .*is it an MLflow database"):
        compare(["lr-high"], f"sqlite:///{garbage}")
    shutil.copyfile(_tracking_template(prepared_data), store)
    tracker = Tracker(f"sqlite:///{store}", "pretrain", tmp_path / "mlartifacts")
    for campaign_id in ("one", "two"):  # two campaigns of one name (different workdirs)
        parent = tracker.campaign_run(campaign_id, "twin", "h", {})
    stage = tracker.stage_run("two", parent, "twin", "main", {})
    with pytest.raises(CompareError, match="several campaigns are named 'twin'.*give the run id or the workdir"):
        compare(["twin"], f"sqlite:///{store}")
    with pytest.raises(CompareError, match="not a campaign's run.*give the campaign run's id"):
        compare([stage], f"sqlite:///{store}")
    with pytest.raises(CompareError, match="cannot read it from MLflow"):
        compare(["0" * 32], f"sqlite:///{store}")
