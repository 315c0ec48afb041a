"""Damaged checkpoint records (manifest, pointers, node records, verdicts): every reader reports
a problem of that checkpoint (or falls back, for pointers) instead of raising. One table of
damaged files, read by verify / resume selection / `pretrain status` / `pretrain eval`."""

from __future__ import annotations

import json

import pytest
import torch

from pretrain.checkpoints.info import CheckpointRejected, describe
from pretrain.state.ledger import Ledger
from pretrain.views.status import campaign_status
from support.campaigns import pretrain_cli, save_checkpoint, seed_data, small_spec
from trainer.checkpoint.records import DamagedRecord, parse_manifest
from trainer.checkpoint.store import GOOD, MANIFEST, POINTER, CheckpointStore, rank_shard_name, step_name
from trainer.storage import LocalStorage


def _store(root) -> CheckpointStore:
    return CheckpointStore(LocalStorage(root), str(root))


def _save(s: CheckpointStore, step: int) -> None:
    shards = [
        s.write_shard(step, "model.pt", {"w": torch.full((4,), float(step)), "step": step}),
        s.write_shard(step, rank_shard_name(0), {"consumed": step * 8}),
    ]
    s.write_node_record(step, "model", 1, shards)
    s.commit(step, shards, {"stage": "s", "world_size": 1})


def _edit_manifest(change):
    def edit(s: CheckpointStore, key: str) -> None:
        m = json.loads(s.storage.get_bytes(key))
        change(m)
        s.storage.put_bytes(key, json.dumps(m).encode())

    return edit


def _truncate(s: CheckpointStore, key: str) -> None:
    data = s.storage.get_bytes(key)
    s.storage.put_bytes(key, data[: len(data) // 2])


def _garbage(s: CheckpointStore, key: str) -> None:
    s.storage.put_bytes(key, b"\xff\x00 not json")


def _a_directory(s: CheckpointStore, key: str) -> None:
    """The key's file replaced by a directory (a hand-made mess: `mkdir` where a file was)."""
    path = s.storage.local_path(key)
    path.unlink()
    path.mkdir()


M8, NODE8 = f"{step_name(8)}/{MANIFEST}", f"{step_name(8)}/node_model.json"
# damage → (key damaged, how, what a reader reports about step 8)
CHECKPOINT_DAMAGE = {
    "truncated manifest": (M8, _truncate, "not valid JSON"),
    "manifest not JSON": (M8, _garbage, "not valid JSON"),
    "manifest is a list": (M8, lambda s, k: s.storage.put_bytes(k, b"[1, 2]"), "not an object"),
    "files is a list": (M8, _edit_manifest(lambda m: m.update(files=list(m["files"]))), "'files'"),
    "entry lacks bytes": (M8, _edit_manifest(lambda m: m["files"]["model.pt"].pop("bytes")), "'bytes'"),
    "shard name ../x": (M8, _edit_manifest(lambda m: m["files"].update({"../x": m["files"]["model.pt"]})), "'../x'"),
    "absolute shard name": (
        M8,
        _edit_manifest(lambda m: m["files"].update({"/etc/passwd": m["files"]["model.pt"]})),
        "'/etc/passwd'",
    ),
    "shard name with /": (
        M8,
        _edit_manifest(lambda m: m["files"].update({"a/b.pt": m["files"]["model.pt"]})),
        "'a/b.pt'",
    ),
    "manifest of another step": (M8, _edit_manifest(lambda m: m.update(step=m["step"] + 1)), "it says step"),
    "manifest is a directory": (M8, _a_directory, "a directory, not a file"),
    "truncated node record": (NODE8, _truncate, "not valid JSON"),
    "node record without shards": (NODE8, lambda s, k: s.storage.put_bytes(k, b'{"world_size": 1}'), "'shards'"),
}


@pytest.mark.parametrize("damage", list(CHECKPOINT_DAMAGE))
def test_a_damaged_record_is_a_problem_of_its_checkpoint(tmp_path, damage):
    s = _store(tmp_path / "ckpt")
    _save(s, 4)
    _save(s, 8)
    key, harm, what = CHECKPOINT_DAMAGE[damage]
    harm(s, key)

    problems = s.verify(8)

    assert len(problems) == 1 and key in problems[0] and "damaged" in problems[0] and what in problems[0], problems
    assert s.verify(4) == []
    assert s.latest_complete().step == 4  # what a worker restoring from storage takes
    assert 8 in s.unjudged()  # the gate judges it (bad)
    s.set_verdict(4, {"verdict": "good", "problems": []})
    assert s.prune(keep=1) == []  # retention reads it without failing (8: the pointer's target, 4: the good one)


def test_a_damaged_verdict_makes_the_step_unjudged_again(tmp_path):
    s = _store(tmp_path / "ckpt")
    _save(s, 4)
    _save(s, 8)
    s.set_verdict(4, {"verdict": "good", "problems": []})
    s.set_verdict(8, {"verdict": "bad", "problems": ["diverged"]})
    _truncate(s, f"{step_name(8)}/verdict.json")
    s.storage.put_bytes(f"{step_name(4)}/verdict.json", b'{"verdict": "maybe"}')

    assert s.verdict(8) is None and s.verdict(4) is None
    assert s.unjudged() == [4, 8]  # judged again by the next gate pass
    assert s.latest_good() is None


POINTER_DAMAGE = {
    "truncated": _truncate,
    "not JSON": _garbage,
    "a directory": _a_directory,
    "no step": lambda s, k: s.storage.put_bytes(k, b'{"dir": "step_00000008"}'),
    "step and dir disagree": lambda s, k: s.storage.put_bytes(k, b'{"step": 8, "dir": "step_00000004"}'),
}


@pytest.mark.parametrize("damage", list(POINTER_DAMAGE))
def test_a_damaged_latest_pointer_is_derived_from_the_manifests(tmp_path, damage):
    s = _store(tmp_path / "ckpt")
    _save(s, 4)
    _save(s, 8)
    s.set_verdict(8, {"verdict": "good", "problems": []})
    POINTER_DAMAGE[damage](s, POINTER)

    assert s.read_pointer() == 8 and s.committed_steps() == [8, 4]
    assert s.latest_complete().step == 8 and s.latest_good().step == 8
    (note,) = s.pointer_problems()
    assert "latest" in note and "damaged" in note and "step 8" in note
    s.rewind(8)  # the orchestrator's next rewind (or the next commit) writes it anew
    assert s.pointer_problems() == [] and s.read_pointer() == 8


@pytest.mark.parametrize("damage", list(POINTER_DAMAGE))
def test_a_damaged_good_pointer_is_ignored(tmp_path, damage):
    s = _store(tmp_path / "ckpt")
    _save(s, 4)
    s.set_verdict(4, {"verdict": "good", "problems": []})
    POINTER_DAMAGE[damage](s, GOOD)

    assert s.read_pointer(GOOD) is None and s.latest_good().step == 4  # recomputed from the verdicts
    assert "ignored" in s.pointer_problems()[0]
    _save(s, 8)
    s.set_verdict(8, {"verdict": "good", "problems": []})  # rewritten by the next good verdict
    assert s.read_pointer(GOOD) == 8 and s.pointer_problems() == []


def test_every_writer_produces_what_the_parser_accepts(tmp_path):
    s = _store(tmp_path / "ckpt")
    _save(s, 4)
    m = parse_manifest(M8, s.storage.get_bytes(f"{step_name(4)}/{MANIFEST}"), 4)
    assert m.step == 4 and set(m.files) == {"model.pt", rank_shard_name(0)} and m.meta["stage"] == "s"
    with pytest.raises(DamagedRecord, match="manifest.json is damaged"):
        parse_manifest(M8, b"{", 8)


# ---- the same damage through `pretrain status` and `pretrain eval` ----------------------------------
@pytest.fixture(scope="module")
def campaign(tmp_path_factory, prepared_data):
    """A campaign workdir with two real checkpoints (steps 2 and 4, both judged good)."""
    spec = small_spec(tmp_path_factory.mktemp("w"), stages=[{"name": "s", "steps": 8, "seq_len": 32, "micro_batch": 4}])
    seed_data(spec, prepared_data)
    Ledger.open(spec).save()
    save_checkpoint(spec, steps=2)
    s = CheckpointStore.of_step(save_checkpoint(spec, steps=4).location)[0]
    for step in (2, 4):
        s.set_verdict(step, {"verdict": "good", "problems": []})
    return spec, s


@pytest.fixture
def damage_of(campaign):
    """``damage_of(key, harm)`` damages one record of the campaign; undone after the test."""
    _, s = campaign
    kept = {}

    def damage(key: str, harm) -> None:
        kept[key] = s.storage.get_bytes(key)
        harm(s, key)

    yield damage
    for key, data in kept.items():
        s.storage.put_bytes(key, data)


STATUS_DAMAGE = {
    **{
        k: v
        for k, v in CHECKPOINT_DAMAGE.items()
        if k in ("truncated manifest", "files is a list", "manifest is a directory")
    },
    "latest pointer": (POINTER, _truncate, "damaged"),
    "good pointer": (GOOD, _truncate, "ignored"),
    "latest pointer is a directory": (POINTER, _a_directory, "a directory, not a file"),
    "verdict": (f"{step_name(8)}/verdict.json", _truncate, "unjudged again"),
    "verdict is a directory": (f"{step_name(8)}/verdict.json", _a_directory, "a directory, not a file"),
}


@pytest.mark.parametrize("damage", list(STATUS_DAMAGE))
def test_status_reports_damaged_records(campaign, damage_of, damage):
    spec, _ = campaign
    key, harm, what = STATUS_DAMAGE[damage]
    damage_of(key.replace(step_name(8), step_name(4)), harm)

    (stage,) = campaign_status(spec.workdir_path)["stages"]

    assert any(what in p for p in stage["problems"]), stage["problems"]


def test_status_command_shows_damaged_records(campaign, damage_of):
    spec, _ = campaign
    damage_of(f"{step_name(4)}/{MANIFEST}", _truncate)
    damage_of(POINTER, _truncate)

    proc = pretrain_cli("status", "--workdir", str(spec.workdir_path))

    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{step_name(4)}/{MANIFEST} is damaged" in proc.stdout and "latest is damaged" in proc.stdout


@pytest.mark.parametrize("damage", [k for k in CHECKPOINT_DAMAGE if "node" not in k])
def test_eval_refuses_a_damaged_manifest_naming_it(campaign, damage_of, damage):
    _, s = campaign
    key, harm, what = CHECKPOINT_DAMAGE[damage]
    damage_of(key.replace(step_name(8), step_name(4)), harm)

    with pytest.raises(CheckpointRejected) as err:
        describe(s.ref(4).location)

    assert any(MANIFEST in p and what in p for p in err.value.problems), err.value.problems
