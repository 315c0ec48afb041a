"""`pretrain export`: a checkpoint becomes a Hugging Face directory that transformers loads as
GPT2LMHeadModel with the same logits, tokens and greedy continuation as our model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from pretrain.checkpoints.export import PROVENANCE, WEIGHTS, export_checkpoint
from pretrain.checkpoints.info import CheckpointRejected, describe
from pretrain.data.prepare.tokenizer import EOT
from support.campaigns import campaign_data_dir, copy_checkpoint, flip_byte, pretrain_cli
from trainer.checkpoint.store import CheckpointStore
from trainer.data.sampler import TokenWindows, read_manifest
from trainer.model import GPT


def our_model(location: str) -> GPT:
    model = GPT(describe(location).model)
    store, step = CheckpointStore.of_step(location)
    model.load_state_dict(store.load_shard(step, "model.pt")["model"])
    return model.eval()


@torch.no_grad()
def greedy(model: GPT, ids: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
    return ids


def test_export_round_trip_matches_our_model(trained_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel  # 1.9 s: not at collection

    spec, ref = trained_checkpoint
    out = tmp_path / "hf"
    proc = pretrain_cli("export", ref.location, str(out))
    assert proc.returncode == 0, proc.stderr
    assert f"exported step 2 of {ref.location}" in proc.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary left behind
    assert {WEIGHTS, "config.json", "tokenizer.json", "tokenizer_config.json", PROVENANCE} <= {
        p.name for p in out.iterdir()
    }

    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    ours = our_model(ref.location)
    assert isinstance(hf, GPT2LMHeadModel)
    data_dir = campaign_data_dir(spec)
    x = torch.stack([TokenWindows(data_dir, "val", 63)[i] for i in range(3)])  # full position table
    with torch.no_grad():
        assert (hf(x).logits - ours(x)).abs().max().item() < 1e-5
    prompt = x[:1, :8]
    assert torch.equal(hf.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0), greedy(ours, prompt, 6))

    tok = AutoTokenizer.from_pretrained(out)
    text = "def loads(s, *, cls=None):\n    return json"
    assert tok(text).input_ids == Tokenizer.from_file(str(data_dir / "tokenizer.json")).encode(text).ids
    assert tok.eos_token == EOT and tok.eos_token_id == hf.config.eos_token_id == read_manifest(data_dir)["eot_id"]

    proc = pretrain_cli("export", ref.location, str(out))
    assert proc.returncode == 2 and "already exists" in proc.stderr and "--overwrite" in proc.stderr


def test_export_refuses_a_corrupted_checkpoint_and_replaces_atomically(trained_checkpoint, tmp_path):
    _, ref = trained_checkpoint
    bad = copy_checkpoint(ref, tmp_path / "bad", lambda d: flip_byte(d / "model.pt"))
    with pytest.raises(CheckpointRejected, match="sha256 does not match"):
        export_checkpoint(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()

    out = tmp_path / "out"
    out.mkdir()
    (out / PROVENANCE).write_text("{}")  # an earlier export
    (out / "stale.txt").write_text("from an earlier export")
    export_checkpoint(ref.location, out, overwrite=True)
    assert not (out / "stale.txt").exists() and (out / WEIGHTS).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "out"]


def test_a_tokenizer_that_cannot_be_read_is_one_line_naming_it(trained_checkpoint, tmp_path):
    spec, ref = trained_checkpoint
    data = tmp_path / "data"
    shutil.copytree(campaign_data_dir(spec), data)
    tokenizer = data / read_manifest(data).get("tokenizer", "tokenizer.json")
    tokenizer.unlink()
    tokenizer.mkdir()  # a directory where the file belongs

    proc = pretrain_cli("export", ref.location, str(tmp_path / "out"), "--data-dir", str(data))

    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"cannot read the data set's tokenizer {tokenizer}" in proc.stderr and "--data-dir" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_an_export_to_where_nothing_can_be_written_is_one_line(trained_checkpoint, tmp_path):
    _, ref = trained_checkpoint
    (tmp_path / "notes.txt").write_text("mine")
    for out in (tmp_path / "notes.txt" / "hf", Path("/proc/no-such-dir/hf")):  # a file on the way; not writable
        proc = pretrain_cli("export", ref.location, str(out))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert f"cannot write the export to {out}" in proc.stderr and "writable directory" in proc.stderr, proc.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.parametrize(
    "out, refused",
    [
        ("wd", "holds the checkpoint"),  # the campaign's workdir
        ("wd/checkpoints", "holds the checkpoint"),  # a parent of the checkpoint
        ("{ckpt}", "is the checkpoint"),  # the checkpoint itself
        ("{ckpt}/hf", "inside the checkpoint"),
        (".", "holds the checkpoint"),  # a parent of the workdir
        ("unrelated", "not an earlier export"),  # someone else's files
        ("previous-export-in-wd", "ledger.json"),  # has pretrain.json, but holds a campaign
        ("previous-export", None),  # replaced
        ("empty", None),  # replaced
    ],
)
def test_export_overwrite_only_replaces_an_earlier_export(trained_checkpoint, tmp_path, out, refused):
    """`pretrain export CKPT OUT --overwrite` never deletes a campaign: OUT is replaced only if it
    is an earlier export (or empty); anything else is refused, exit 2, every file still there."""
    _, ref = trained_checkpoint
    wd = tmp_path / "wd"
    ckpt = copy_checkpoint(ref, wd / "checkpoints")
    out = out.format(ckpt=Path(ckpt).relative_to(tmp_path))
    (wd / "ledger.json").write_text('{"campaign": "x"}')
    (tmp_path / "unrelated").mkdir()
    (tmp_path / "unrelated" / "notes.txt").write_text("mine")
    for d in ("previous-export", "previous-export-in-wd"):
        (tmp_path / d).mkdir()
        (tmp_path / d / PROVENANCE).write_text("{}")
    (tmp_path / "previous-export-in-wd" / "ledger.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    before = _files(tmp_path)
    proc = pretrain_cli("export", ckpt, str(tmp_path / out), "--overwrite")
    if refused:
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert refused in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert _files(tmp_path) == before  # nothing deleted, nothing left behind
    else:
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / out / WEIGHTS).is_file() and _files(tmp_path) >= before


def test_eval_and_export_take_a_campaigns_workdir_and_its_newest_good_checkpoint(trained_checkpoint, tmp_path):
    """As `status` and `report` do, `eval` and `export` take the campaign's workdir (for the
    checkpoint, or --workdir): its newest good checkpoint, read from the workdir's own
    checkpoints when the campaign was copied from elsewhere."""
    import json

    from pretrain.spec.layout import CampaignLayout
    from pretrain.state.ledger import Ledger
    from pretrain.state.schema import VerdictRecord

    spec, ref = trained_checkpoint
    copy = tmp_path / "copied"
    shutil.copytree(spec.workdir_path, copy)
    ledger = Ledger.read(CampaignLayout(copy))
    stage = spec.stages[0].name
    nothing = pretrain_cli("eval", str(copy))
    assert nothing.returncode == 2 and "has no good checkpoint yet" in nothing.stderr, nothing.stderr
    ledger.record_verdict(
        stage, VerdictRecord(step=ref.step, path=ref.location, verdict="good")
    )  # the original's place
    own = str(copy / "checkpoints" / stage / Path(ref.location).name)
    for args in ((str(copy),), ("--workdir", str(copy))):
        shown = pretrain_cli("eval", *args, "--json", "--max-batches", "1")
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["checkpoint"] == own
    both = pretrain_cli("eval", str(copy), "--workdir", str(copy))
    assert both.returncode == 2 and "not both" in both.stderr
    done = pretrain_cli("export", str(tmp_path / "out"), "--workdir", str(copy))
    assert done.returncode == 0, done.stderr
    assert f"of {own} to" in done.stdout and (tmp_path / "out" / WEIGHTS).is_file()
    missing = pretrain_cli("export", str(tmp_path / "out2"))
    assert missing.returncode == 2 and "give the directory to export to" in missing.stderr
    assert "Traceback" not in missing.stderr + both.stderr + nothing.stderr
