"""What ``pretrain run`` / ``data prepare`` refuse before starting anything (pretrain/cli/before_start.py),
and what they leave to the flow."""

from __future__ import annotations

import json

import pytest

from pretrain.cli.before_start import refuse_before_starting
from pretrain.data.corpus.files import CorpusError
from pretrain.spec.campaign import parse_spec
from pretrain.spec.layout import CampaignLayout, UnusableWorkdir
from pretrain.state.ledger import CampaignMismatch, Ledger, LedgerError, ledger_location
from support.campaigns import small_spec

OTHER_MODEL = {"n_layer": 1, "n_head": 2, "d_model": 32, "max_seq_len": 64}


def started_by_another_spec(workdir):
    Ledger.open(small_spec(workdir, model=OTHER_MODEL)).save()


def damaged(workdir):
    workdir.mkdir(parents=True)
    (workdir / "ledger.json").write_text('{"campaign": "t", "stag')


def a_file(workdir):
    workdir.parent.mkdir(parents=True, exist_ok=True)
    workdir.write_text("not a directory")


STATE_ON_S3 = {"state_uri": "s3://bucket/campaign", "s3_endpoint_url": "http://127.0.0.1:9"}  # (never asked)


def a_copy(workdir):
    spec = small_spec(workdir, checkpoint=STATE_ON_S3)
    workdir.mkdir(parents=True)
    copy = Ledger(CampaignLayout(workdir), Ledger.open(small_spec(workdir)).record)
    copy.record.copy_of = ledger_location(spec)
    (workdir / "ledger.json").write_text(json.dumps(copy.record.to_json()))


CASES = {  # name: (what is in the workdir, spec sections, check sources, refused with, workdir made)
    "an empty workdir is made": (None, {}, False, None, True),
    "a file where the workdir should be": (a_file, {}, False, UnusableWorkdir, False),
    "another spec's campaign": (started_by_another_spec, {}, False, CampaignMismatch, True),
    "another spec's campaign, spec with a block (hashed as resolved: the flow checks)": (
        started_by_another_spec,
        {"blocks": {"tracking": "mlflow-tracking/team"}},
        False,
        None,
        True,
    ),
    "a damaged ledger": (damaged, {}, False, LedgerError, True),
    "a damaged ledger file in the workdir of a campaign kept at state_uri (it may be another campaign's)": (
        damaged,
        {"checkpoint": STATE_ON_S3},
        False,
        LedgerError,
        True,
    ),
    "a campaign kept in the workdir, the spec's state at state_uri": (
        started_by_another_spec,
        {"checkpoint": STATE_ON_S3},
        False,
        LedgerError,
        True,
    ),
    "the workdir's copy of the ledger kept at state_uri": (a_copy, {"checkpoint": STATE_ON_S3}, False, None, True),
    "a storage block decides the workdir: the spec's is not made": (
        None,
        {"blocks": {"storage": "local-campaign-storage/shared"}},
        False,
        None,
        False,
    ),
    "local sources that match nothing (data prepare)": (
        None,
        {"data": {"sources": ["/nonexistent/corpus/*.jsonl"]}},
        True,
        CorpusError,
        True,
    ),
    "the same sources, run (a prepared campaign may have dropped its raw corpus)": (
        None,
        {"data": {"sources": ["/nonexistent/corpus/*.jsonl"]}},
        False,
        None,
        True,
    ),
    "sources on S3 are the flow's to list (credentials)": (
        None,
        {"data": {"sources": ["s3://bucket/corpus/*.jsonl"]}},
        True,
        None,
        True,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_what_a_command_refuses_before_starting(tmp_path, monkeypatch, case):
    setup, sections, sources, refused, made = CASES[case]
    workdir = tmp_path / "campaigns" / "w"
    if setup is not None:
        setup(workdir)
    if "storage" in sections.get("blocks", {}):  # the block gives the workdir: the spec has none,
        monkeypatch.chdir(tmp_path)  # its default would be ./runs/<name>
        spec = parse_spec({**small_spec(workdir).model_dump(mode="json", exclude={"workdir"}), **sections})
        workdir = spec.workdir_path
    else:
        spec = small_spec(workdir, **sections)
    if refused is None:
        refuse_before_starting(spec, sources=sources)
    else:
        with pytest.raises(refused):
            refuse_before_starting(spec, sources=sources)
    assert workdir.is_dir() == made
