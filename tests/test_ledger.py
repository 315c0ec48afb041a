"""A damaged ledger.json is one clear error naming the file and how to recover; every save keeps
the previous generation (ledger.json.prev), which `pretrain recover-ledger` restores."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import pretrain_cli, small_spec
from pretrain.layout import CampaignLayout
from pretrain.ledger import Ledger, LedgerDamaged, LedgerError, recover_ledger
from pretrain.ledger_schema import CampaignStatus


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _edit(change):
    def edit(path):
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))
    return edit


DAMAGE = {
    "truncated": (_truncate, "not valid JSON"),
    "not JSON": (lambda p: p.write_bytes(b"\x00\xff garbage"), "not valid JSON"),
    "empty": (lambda p: p.write_bytes(b""), "not valid JSON"),
    "a list": (lambda p: p.write_text("[]"), "not a JSON object"),
    "no stages": (_edit(lambda d: d.pop("stages")), "'stages'"),
    "stages a list": (_edit(lambda d: d.update(stages=[])), "'stages'"),
    "stage without status": (_edit(lambda d: d["stages"]["warmup"].pop("status")), "'status'"),
    "attempts a string": (_edit(lambda d: d["stages"]["main"].update(attempts="2")), "'attempts'"),
    "verdict without verdict": (_edit(lambda d: d["stages"]["main"]["verdicts"].append({"step": 4})), "'verdict'"),
}


@pytest.fixture
def spec(tmp_path):
    spec = small_spec(tmp_path / "w")
    ledger = Ledger.open(spec)
    ledger.save()
    ledger.begin_run("a-flow-run")  # a second generation: .prev holds the first
    return spec


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_ledger_is_one_clear_error_offering_the_previous_generation(spec, damage):
    layout = CampaignLayout(spec.workdir_path)
    harm, what = DAMAGE[damage]
    harm(layout.ledger)

    with pytest.raises(LedgerDamaged) as err:
        Ledger.open(spec)

    msg = str(err.value)
    assert str(layout.ledger) in msg and what in msg, msg
    assert "ledger.json.prev is intact" in msg and f"pretrain recover-ledger --workdir {layout.root}" in msg


def test_every_save_keeps_the_previous_generation(spec):
    layout = CampaignLayout(spec.workdir_path)
    before = layout.ledger.read_bytes()
    Ledger.open(spec).set_status(CampaignStatus.COMPLETED)
    assert layout.ledger.with_name("ledger.json.prev").read_bytes() == before
    assert json.loads(layout.ledger.read_text())["status"] == "completed"


def test_status_and_run_refuse_a_damaged_ledger_and_recover_ledger_restores_it(spec, tmp_path):
    root = spec.workdir_path
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    _truncate(root / "ledger.json")

    for args in (("status", "--workdir", str(root)), ("run", str(spec_file), "--workdir", str(root))):
        proc = pretrain_cli(*args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
        assert "ledger.json is damaged" in proc.stderr and "pretrain recover-ledger" in proc.stderr, proc.stderr

    proc = pretrain_cli("recover-ledger", "--workdir", str(root))

    assert proc.returncode == 0, proc.stderr
    (aside,) = root.glob("ledger.json.damaged-*")  # kept, never deleted
    assert str(aside) in proc.stdout and json.loads((root / "ledger.json").read_text())["status"] == "new"
    assert pretrain_cli("status", "--workdir", str(root)).returncode == 0


def test_without_an_intact_previous_generation_the_error_says_what_to_do(spec):
    layout = CampaignLayout(spec.workdir_path)
    _truncate(layout.ledger)
    _truncate(layout.ledger.with_name("ledger.json.prev"))

    with pytest.raises(LedgerDamaged, match="no intact previous generation") as err:
        recover_ledger(layout.root)

    assert "checkpoints" in str(err.value) and layout.ledger.exists()  # nothing moved, nothing lost
    assert not list(layout.root.glob("ledger.json.damaged-*"))


def test_recover_ledger_leaves_an_intact_ledger_alone(spec):
    layout = CampaignLayout(spec.workdir_path)
    before = layout.ledger.read_bytes()
    with pytest.raises(LedgerError, match="is intact"):
        recover_ledger(layout.root)
    assert layout.ledger.read_bytes() == before
