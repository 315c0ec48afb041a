"""Data preparation and the global-position sampler."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from pretrain.data.prepare.pipeline import prepare
from pretrain.spec.data import DataSpec
from trainer.data.sampler import DataError, GlobalSampler, TokenWindows, micro_batch_positions, read_manifest


def test_prepared_data_set_is_complete_and_decodes(prepared_data):
    m = read_manifest(prepared_data)
    assert m["tokens"]["train"] > 0 and m["tokens"]["val"] > 0
    for split, shards in m["splits"].items():
        arr = np.concatenate([np.fromfile(prepared_data / s["file"], dtype=m["dtype"]) for s in shards])
        assert len(arr) == m["tokens"][split] and arr.max() < m["vocab_size"]
    tok = Tokenizer.from_file(str(prepared_data / m["tokenizer"]))
    text = "def f(x):\n    return json.dumps(x)\n"
    assert tok.decode(tok.encode(text).ids) == text


@pytest.mark.parametrize("world, micro, accum", [(1, 8, 1), (2, 4, 1), (4, 1, 2), (2, 2, 2)])
def test_each_step_reads_a_disjoint_complete_partition(world, micro, accum):
    consumed = 24
    seen = [
        p
        for m in range(accum)
        for r in range(world)
        for p in micro_batch_positions(consumed, world=world, rank=r, micro=micro, accum_index=m)
    ]
    assert sorted(seen) == list(range(consumed, consumed + world * micro * accum))


def test_sampler_covers_every_window_once_per_epoch(prepared_data):
    windows = TokenWindows(prepared_data, "train", 32)
    s = GlobalSampler(len(windows), seed=7, stream=1)
    n = len(windows)
    assert sorted(s.index(p) for p in range(n)) == list(range(n))
    assert [s.index(p) for p in range(n, 2 * n)] != [s.index(p) for p in range(n)]  # new epoch, new order
    assert GlobalSampler(n, seed=7, stream=1).index(5) == s.index(5)


def test_data_groups_are_packed_separately_and_mixed_in_exact_proportions(tmp_path):
    from pretrain.spec.campaign import parse_spec
    from trainer.data.sampler import MixtureSampler

    spec = DataSpec(
        sources={"json": ["{stdlib}/json/*.py"], "email": ["{stdlib}/email/*.py"]},
        max_bytes=60_000,
        tokenizer={"vocab_size": 300},
        val_fraction=0.2,
    )
    m = prepare(spec, tmp_path / "data", work=tmp_path / "work", log=lambda *_: None)
    assert set(m["groups"]) == {"json", "email"} and all(g["train"] > 0 for g in m["groups"].values())
    windows = TokenWindows(m["location"], "train", 16)
    assert set(windows.groups) == {"json", "email"}
    assert sum(len(r) for r in windows.groups.values()) == len(windows)

    sampler = MixtureSampler(windows.groups, {"json": 3, "email": 1}, seed=7, stream=2)
    picks = [sampler.index(p) for p in range(4000)]
    in_json = [i in windows.groups["json"] for i in picks]
    assert sum(in_json) == 3000  # exactly 3:1 over whole periods
    assert all(sum(in_json[k : k + 4]) == 3 for k in range(0, 4000, 4))  # and evenly at every scale
    n_json = len(windows.groups["json"])
    first_epoch = [i for i in picks if i in windows.groups["json"]][:n_json]
    assert sorted(first_epoch) == list(windows.groups["json"])  # each group: every window once per epoch
    again = MixtureSampler(windows.groups, {"json": 0.75, "email": 0.25}, seed=7, stream=2)
    assert [again.index(p) for p in range(1234, 1300)] == picks[1234:1300]  # a pure function of the position

    with pytest.raises(Exception, match=r"stages\.0\.mixture|stages\[0\]\.mixture names data group"):
        parse_spec(
            {"data": {"sources": {"json": ["x"]}}, "stages": [{"name": "a", "steps": 1, "mixture": {"code": 1}}]}
        )


@pytest.mark.parametrize(
    "damage",
    [
        lambda t: t[: len(t) // 2],  # truncated (a killed writer on a filesystem without atomic rename)
        lambda t: b"\xff\xfe not utf-8",
        lambda t: b"[1, 2, 3]",  # JSON, but not a data manifest
        lambda t: t.replace(b'"splits"', b'"splats"'),  # a hand edit
        lambda t: t.replace(b'"version": 2', b'"version": 7'),  # written by a newer release
        lambda t: t.replace(b'"file": "train_00000.bin"', b'"file": "../../etc/passwd"'),  # a shard outside the set
        lambda t: t.replace(b'"fingerprint"', b'"fingerprunt"'),  # version 2 without its fingerprint
        None,  # a directory where the file belongs
    ],
    ids=[
        "truncated",
        "not utf-8",
        "a list",
        "no splits",
        "newer version",
        "shard outside",
        "no fingerprint",
        "a directory",
    ],
)
def test_a_damaged_data_manifest_is_a_clear_error_and_preparation_redoes_it(tmp_path, damage):
    spec = DataSpec(sources=["{stdlib}/json/*.py"], max_bytes=50_000, tokenizer={"vocab_size": 300})
    out = Path(prepare(spec, tmp_path / "data", work=tmp_path / "work", log=lambda *_: None)["location"])
    manifest = out / "manifest.json"
    if damage is None:
        manifest.unlink()
        manifest.mkdir()
    else:
        manifest.write_bytes(damage(manifest.read_bytes()))
    with pytest.raises(DataError) as raised:  # what a worker, the gate or the evaluation would read
        read_manifest(out)
    assert str(manifest) in str(raised.value)
    assert "run data preparation again" in str(raised.value)
    logged: list[str] = []
    again = prepare(spec, tmp_path / "data", work=tmp_path / "work", log=logged.append)  # prepared anew, not a crash
    assert again["reused"] is False and read_manifest(out)["fingerprint"] == again["fingerprint"]
    assert any("is damaged" in line and "preparing it again" in line for line in logged)
