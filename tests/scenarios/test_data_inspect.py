"""``pretrain data inspect`` of a large corpus's data set and of a campaign (its workdir)."""

from __future__ import annotations

import io
import shutil

import pytest
from rich.console import Console

from pretrain.cli.workdir_lookup import campaign_data_set
from pretrain.data.inspection import SOURCE_ROWS, render_summary
from pretrain.state.ledger import Ledger
from pretrain.views.status import NoCampaign
from support.campaigns import pretrain_cli, seed_data, small_spec


def shown(manifest: dict, **kwargs) -> str:
    out = io.StringIO()
    render_summary(manifest, Console(file=out, width=300), **kwargs)
    return out.getvalue()


def test_a_corpus_of_many_files_lists_twenty_and_sums_the_others_in_one_row():
    sources = [
        {
            "uri": f"s3://corpus/part-{i:05d}.jsonl",
            "format": "jsonl",
            "group": "all",
            "units": 1,
            "documents": 10 + i,
            "tokens": 1000 * (i + 1),
            "skipped": {"duplicate": i % 2},
        }
        for i in range(25)
    ]
    sources += ["not a source", {"uri": "hand-edited", "tokens": "many", "skipped": [1]}]  # a damaged manifest's
    manifest = {"location": "/data/f", "fingerprint": "f", "tokens": {"train": 1, "val": 1}, "sources": sources}
    text = shown(manifest)
    assert [f"part-{i:05d}" in text for i in range(25)] == [True] * SOURCE_ROWS + [False] * 5
    rest = sources[SOURCE_ROWS:25]
    assert (
        "… and 6 more sources (`pretrain data inspect /data/f --all-sources` lists each)" in text
        and f"{sum(s['tokens'] for s in rest):,}" in text
    )
    assert f"duplicate {sum(s['skipped']['duplicate'] for s in rest)}" in text and "hand-edited" not in text
    every = shown(manifest, source_rows=None)
    assert all(f"part-{i:05d}" in every for i in range(25)) and "hand-edited" in every and "more sources" not in every
    assert "many" in every  # shown as it is


def test_inspect_takes_a_campaigns_workdir_and_reads_a_copy_s_own_data_set(prepared_data, tmp_path):
    spec = small_spec(tmp_path / "w")
    seed_data(spec, prepared_data, own_store=False)
    data_set = spec.workdir_path / "data" / prepared_data.name
    proc = pretrain_cli("data", "inspect", str(spec.workdir_path), "--windows", "1", "--tokens", "8")
    assert proc.returncode == 0 and f"data set {data_set}: fingerprint" in proc.stdout, proc.stderr
    assert proc.stdout.count("@ token") == 1
    copy = tmp_path / "copy"
    shutil.copytree(spec.workdir_path, copy)
    assert campaign_data_set(copy) == str(copy / "data" / prepared_data.name)  # not the original's
    assert campaign_data_set(None, here=tmp_path / "w") == str(data_set)  # run where the campaign is


def test_inspect_of_a_campaign_without_a_data_set_says_how_to_make_it(tmp_path):
    spec = small_spec(tmp_path / "w")
    Ledger.open(spec).save()
    proc = pretrain_cli("data", "inspect", str(spec.workdir_path))
    assert proc.returncode == 2 and "has no data set yet: `pretrain data prepare` makes it" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    with pytest.raises(NoCampaign, match="no campaign in"):
        campaign_data_set(None, here=tmp_path)
