"""A campaign's checkpoints belong to the data set they were trained on: the ledger records it,
a changed data set is refused with what changed, a campaign of the release before keeps its own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flows.campaign import pretrain_campaign
from flows.prepare_data import prepare_data
from pretrain.data.identity import DataChanged, refuse_changed_data, what_changed
from pretrain.run.jobs import build_job, checkpoint_store
from pretrain.spec.campaign import parse_spec
from pretrain.state.ledger import Ledger
from pretrain.state.schema import CampaignRecord, DataRecord, new_stage
from support.campaigns import DATA, small_spec
from trainer.data.cache import job_data
from trainer.data.sampler import TokenWindows, read_manifest

SRC = {"uri": "/c/a.jsonl", "format": "jsonl", "group": "all", "identity": "10:1", "size": 10, "documents": 3}
OLD = {
    "fingerprint": "aaaa",
    "vocab_size": 512,
    "tokenizer_sha256": "t1",
    "settings": {"val_fraction": 0.05},
    "sources": [SRC, {**SRC, "uri": "/c/b.jsonl"}],
}


@pytest.mark.parametrize(
    "new, expected",
    [
        ({**OLD, "sources": [*OLD["sources"], {**SRC, "uri": "/c/c.jsonl"}]}, ["sources added: /c/c.jsonl"]),
        ({**OLD, "sources": OLD["sources"][:1]}, ["sources removed: /c/b.jsonl"]),
        (
            {**OLD, "sources": [{**SRC, "identity": "12:2", "size": 12}, OLD["sources"][1]]},
            ["sources changed: /c/a.jsonl"],
        ),
        ({**OLD, "tokenizer_sha256": "t2"}, ["tokenizer: 512 tokens (sha256 t1) → 512 tokens (sha256 t2)"]),
        ({**OLD, "settings": {"val_fraction": 0.1}}, ["setting val_fraction: 0.05 → 0.1"]),
        (
            {**OLD, "sources": [{**SRC, "uri": f"/c/{i}.jsonl"} for i in range(8)]},
            [
                "sources added: /c/0.jsonl, /c/1.jsonl, /c/2.jsonl, /c/3.jsonl, /c/4.jsonl and 3 more",
                "sources removed: /c/a.jsonl, /c/b.jsonl",
            ],
        ),
        (OLD, ["the source files' identities changed (size and modification time, or S3 ETag), not their list"]),
    ],
)
def test_what_changed_between_two_data_sets_is_named(new, expected):
    assert what_changed(OLD, new) == expected


def test_what_changed_says_when_it_cannot_compare():
    v1 = {k: v for k, v in OLD.items() if k not in ("sources", "settings", "tokenizer_sha256")}
    assert what_changed(v1, {**OLD, "tokenizer_sha256": None})[0].startswith(
        "the old data set was prepared by an earlier release"
    )
    assert what_changed(None, OLD) == ["the old data set's manifest cannot be read, so what changed cannot be listed"]


def _record(fingerprint: str | None, attempts: int) -> CampaignRecord:
    stage = new_stage(10, "/ckpt/main")
    stage.attempts = attempts
    return CampaignRecord(
        campaign="t",
        campaign_id="x",
        spec_hash="h",
        status="running",
        invocations=1,
        mlflow={"tracking_uri": "sqlite://", "experiment": "e"},
        stages={"main": stage},
        data=DataRecord(fingerprint=fingerprint, location="/d/aaaa") if fingerprint else None,
    )


@pytest.mark.parametrize(
    "recorded, attempts, refused",
    [
        ("aaaa", 1, True),  # trained on aaaa, now bbbb
        ("aaaa", 0, False),  # nothing trained yet: the new data set is simply recorded
        ("bbbb", 3, False),  # the same data set
        (None, 2, False),  # nothing recorded
    ],
)
def test_resuming_on_another_data_set_is_refused_only_when_stages_trained_on_the_recorded_one(
    recorded, attempts, refused
):
    new = {**OLD, "fingerprint": "bbbb", "location": "/d/bbbb", "sources": OLD["sources"][:1]}
    if not refused:
        refuse_changed_data(_record(recorded, attempts), new, OLD)
        return
    with pytest.raises(DataChanged) as err:
        refuse_changed_data(_record(recorded, attempts), new, OLD)
    message = str(err.value)
    assert "stage(s) 'main' have checkpoints made on data set aaaa (/d/aaaa)" in message
    assert "now gives bbbb (/d/bbbb)" in message and "sources removed: /c/b.jsonl" in message
    assert "restore the old sources" in message and "init_from" in message and "tokenizer.path" not in message
    with pytest.raises(DataChanged, match=r"(?s)tokenizer: 512 tokens.*give the old one as data\.tokenizer\.path"):
        refuse_changed_data(_record(recorded, attempts), {**new, "tokenizer_sha256": "t2"}, OLD)


def test_a_campaign_of_the_release_before_keeps_its_flat_data_set(prefect_harness, tmp_path, prepared_data):
    """The release before prepared data flat in <workdir>/data (manifest v1) and recorded no location."""
    from test_ledger import _release_before_workdir

    spec, before = _release_before_workdir(tmp_path)
    flat = spec.layout.data_dir
    shutil.copytree(prepared_data, flat)
    v2 = read_manifest(flat)
    v1 = {
        k: v2[k] for k in ("fingerprint", "dtype", "vocab_size", "eot_id", "tokenizer", "splits", "documents", "tokens")
    }
    (flat / "manifest.json").write_text(json.dumps({**v1, "version": 1, "fingerprint": before["data"]["fingerprint"]}))

    job = build_job(spec, 0, 3, None)  # what the next launch of its stage trains on
    assert job.data.uri == str(flat) and job.data.fingerprint == before["data"]["fingerprint"]
    assert len(TokenWindows(job_data(job), "train", 32)) > 0
    assert Ledger.open(spec).record.data.to_json() == before["data"]  # the record reads and writes back as it was

    with_location = prepare_data(spec)  # the campaign's first step: nothing prepared again
    assert with_location["location"] == str(flat) and with_location["fingerprint"] == before["data"]["fingerprint"]
    assert sorted(p.name for p in flat.iterdir() if p.is_dir()) == []  # no <fingerprint>/ data set made beside it
    assert Ledger.open(spec).record.data.location == str(flat)


def test_resuming_a_campaign_whose_corpus_changed_is_refused_naming_what_changed(prefect_harness, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in sorted(Path(json.__file__).parent.glob("*.py")):
        shutil.copy(f, corpus / f.name)
    spec = small_spec(
        tmp_path / "wd",
        data={**DATA, "sources": [f"{corpus}/*.py"]},
        stages=[{"name": "main", "steps": 4, "seq_len": 32, "micro_batch": 4, "warmup_steps": 1}],
    )
    assert pretrain_campaign(spec=spec)["status"] == "completed"
    before = json.loads(spec.layout.ledger.read_text())
    checkpoint = before["stages"]["main"]["good_checkpoint"]["path"]
    assert checkpoint_store(spec, "main").manifest(4).meta["data_fingerprint"] == before["data"]["fingerprint"]

    (corpus / "added.py").write_text("def added():\n    return 'a file that was not there'\n" * 20)
    with pytest.raises(DataChanged) as err:
        pretrain_campaign(spec=spec)

    message = str(err.value)
    assert f"have checkpoints made on data set {before['data']['fingerprint']}" in message
    assert f"sources added: {corpus / 'added.py'}" in message
    assert "restore the old sources" in message and f"init_from: {checkpoint}" in message
    after = json.loads(spec.layout.ledger.read_text())
    assert after["data"] == before["data"] and after["stages"] == before["stages"]  # nothing recorded on the new data

    # the second way on: a new campaign on the new data starting from this one's weights
    body = spec.model_dump(mode="json", exclude={"workdir"})
    body["stages"][0]["init_from"] = checkpoint
    follow_up = parse_spec({**body, "name": "t2", "workdir": str(tmp_path / "wd2")})
    status = pretrain_campaign(spec=follow_up)
    assert status["status"] == "completed" and status["data"]["fingerprint"] != before["data"]["fingerprint"]
    first = status["stages"][0]["resumes"][0]
    assert (first["source"], first["checkpoint"]) == ("init_from", checkpoint)
