"""Secrets never reach MLflow params and tags, Prefect artifacts, the ledger or `pretrain status`:
credential-shaped values are redacted by every writer (the spec refuses them first)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from mlflow.tracking import MlflowClient

from pretrain.credentials import Credentials, mlflow_auth
from pretrain.redact import redact, redact_mapping
from pretrain.state.ledger import Ledger
from pretrain.state.schema import Failure
from pretrain.tracking.runs import Tracker
from pretrain.views.report import campaign_report
from support.campaigns import pretrain_cli, small_spec

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCY"


@pytest.mark.parametrize(
    "text, expected",
    [
        (f"s3://AKIAIOSFODNN7EXAMPLE:{SECRET}@bucket/ckpt", "s3://***@bucket/ckpt"),
        (f"https://user:{SECRET}@mlflow.example.com:5000/api", "https://***@mlflow.example.com:5000/api"),
        (f"failed: aws_secret_access_key={SECRET} for x", "failed: aws_secret_access_key=*** for x"),
        (f"https://mlflow/x?password={SECRET}&token={SECRET}&page=2", "https://mlflow/x?password=***&token=***&page=2"),
        (f'{{"MLFLOW_TRACKING_TOKEN": "{SECRET}"}}', '{"MLFLOW_TRACKING_TOKEN": "***"}'),
        (f"Authorization: Bearer {SECRET}", "Authorization: Bearer ***"),
        ("key id AKIAIOSFODNN7EXAMPLE and ASIAIOSFODNN7EXAMPLE", "key id *** and ***"),
        # left alone: what only looks close
        ("s3://bucket/campaigns/t/main/step_00000040", "s3://bucket/campaigns/t/main/step_00000040"),
        ("sqlite:////tmp/team@lab/mlflow.db", "sqlite:////tmp/team@lab/mlflow.db"),
        (
            "tokenizer: tokenizer.json, max_new_tokens=32, tokens_per_s=1200",
            "tokenizer: tokenizer.json, max_new_tokens=32, tokens_per_s=1200",
        ),
        ("loss 2.31 at step 40 (user@host)", "loss 2.31 at step 40 (user@host)"),
    ],
)
def test_redaction_table(text, expected):
    assert redact(text) == expected
    assert redact(expected) == expected  # idempotent


def test_values_under_secret_names_are_masked_whole():
    assert redact_mapping({"cfg.aws_secret_access_key": "abc", "token": "x y", "data.max_bytes": 5, "note": ""}) == {
        "cfg.aws_secret_access_key": "***",
        "token": "***",
        "data.max_bytes": "5",
        "note": "",
    }


def test_mlflow_params_and_tags_are_redacted(tmp_path, own_tracking_store):
    """Real MLflow (sqlite): a credential-shaped param or tag value is stored redacted."""
    uri = own_tracking_store
    tracker = Tracker(uri, "exp", tmp_path / "artifacts")
    run_id = tracker.campaign_run(
        "cid",
        "c",
        "hash",
        {
            "checkpoint": {"uri": f"s3://AKIAIOSFODNN7EXAMPLE:{SECRET}@bucket/x", "secret_key": SECRET},
            "note": f"password={SECRET}",
        },
    )
    tracker.set_tags(run_id, {"checkpoint.latest": f"https://u:{SECRET}@host/ckpt", "auth": f"Bearer {SECRET}"})
    run = MlflowClient(uri).get_run(run_id)
    stored = json.dumps({**run.data.params, **run.data.tags})
    assert SECRET not in stored and "AKIAIOSFODNN7EXAMPLE" not in stored
    assert (
        run.data.params["checkpoint.uri"] == "s3://***@bucket/x" and run.data.params["checkpoint.secret_key"] == "***"
    )
    assert run.data.tags["checkpoint.latest"] == "https://***@host/ckpt"


def test_report_and_status_are_redacted(tmp_path):
    """The campaign report (the Prefect markdown artifact) and `pretrain status` never show a secret
    that reached the ledger some other way (here: a worker's error message)."""
    spec = small_spec(tmp_path / "wd")
    ledger = Ledger.open(spec)
    ledger.save()
    ledger.record_failure(
        "main",
        Failure(
            attempt=0,
            cause=f"storage: aws_secret_access_key={SECRET}",
            action="stop",
            time_lost_s=1.0,
            errors=[f"PUT s3://AKIAIOSFODNN7EXAMPLE:{SECRET}@b/k failed"],
        ),
    )
    report = campaign_report(spec.workdir_path)
    assert "aws_secret_access_key=***" in report and SECRET not in report
    proc = pretrain_cli("status", "--workdir", str(spec.workdir_path), "--json")
    assert proc.returncode == 0, proc.stderr
    assert SECRET not in proc.stdout and "AKIAIOSFODNN7EXAMPLE" not in proc.stdout and "s3://***@b/k" in proc.stdout


class _Recorder(BaseHTTPRequestHandler):
    seen: list[str | None] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        type(self).seen.append(self.headers.get("Authorization"))
        body = json.dumps({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no such experiment"}).encode()
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_mlflow_token_reaches_requests_inside_its_context_only(monkeypatch):
    """An MLflow block's token authenticates this context's MLflow requests, without going into
    os.environ (where later runs of other campaigns would find it)."""
    monkeypatch.delenv("MLFLOW_TRACKING_TOKEN", raising=False)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = MlflowClient(f"http://127.0.0.1:{server.server_port}")
        with mlflow_auth(Credentials({"MLFLOW_TRACKING_TOKEN": SECRET})):
            assert client.get_experiment_by_name("e") is None
            assert "MLFLOW_TRACKING_TOKEN" not in __import__("os").environ
        client.get_experiment_by_name("e")
    finally:
        server.shutdown()
        server.server_close()
    assert _Recorder.seen == [f"Bearer {SECRET}", None]
