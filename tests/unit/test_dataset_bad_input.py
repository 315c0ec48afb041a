"""Data preparation with bad input or its own files damaged: a corpus without enough documents, a
bad record, a full disk, an unusable tokenizer, a failing progress display, a torn work unit, a
torn cached tokenizer, a missing or truncated shard. Each is a clear error that leaves no data set
behind, or is prepared again — never a crash, never a damaged file trusted."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretrain.data.prepare.errors import DataPrepError
from pretrain.data.prepare.pipeline import prepare
from support.corpora import QUIET, data_set_bytes, docs, jsonl_corpus, spec, wide_tokenizer, write_jsonl
from trainer.data.manifest import MANIFEST
from trainer.data.sampler import read_manifest


@pytest.mark.parametrize(
    "files, message",
    [
        ({"a.txt": b"", "b.txt": b"  \n"}, r"gave no documents \(2 file\(s\); skipped: 2 empty\)"),
        ({"a.bin": b"\x00\x01\x02" * 100}, r"gave no documents \(1 file\(s\); skipped: 1 binary\)"),
        ({"one.txt": b"just one document"}, r"gave 1 distinct document\(s\); need at least 2"),
    ],
    ids=["empty", "binary", "one document"],
)
def test_a_corpus_without_enough_documents_is_a_clear_error_and_no_data_set(tmp_path, files, message):
    for name, raw in files.items():
        (tmp_path / "corpus").mkdir(exist_ok=True)
        (tmp_path / "corpus" / name).write_bytes(raw)
    with pytest.raises(DataPrepError, match=message):
        prepare(spec([str(tmp_path / "corpus/*")]), tmp_path / "data", work=tmp_path / "w", **QUIET)
    assert not list((tmp_path / "data").glob(f"*/{MANIFEST}"))


def test_a_bad_jsonl_line_in_a_worker_stops_preparation_naming_file_and_line(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", docs(30))
    with open(corpus, "a") as f:
        f.write("{not json\n")
    with pytest.raises(ValueError, match=rf"{corpus}.*line 31"):
        prepare(
            spec([str(corpus)], tokenizer={"path": str(wide_tokenizer(tmp_path / "t.json", 1000))}),
            tmp_path / "data",
            work=tmp_path / "w",
            **QUIET,
        )
    skipped = prepare(spec([str(corpus)], on_bad_record="skip"), tmp_path / "data", work=tmp_path / "w", **QUIET)
    assert skipped["skipped"]["bad_record"] == 1 and sum(skipped["documents"].values()) == 30


def test_data_prep_that_fills_the_disk_leaves_no_data_set_and_a_retry_after_freeing_space_works(tmp_path):
    from support.tmpfs import resize_tmpfs, small_tmpfs

    data = spec(["{stdlib}/json/*.py"], tokenizer={"vocab_size": 400}, val_fraction=0.2, shard_tokens=2048)
    with small_tmpfs(tmp_path / "fs", "32k") as fs:
        with pytest.raises(DataPrepError, match=rf"no space left on {fs} \(tmpfs.*Free space there"):
            prepare(data, fs / "data", work=tmp_path / "work", **QUIET)
        assert not list((fs / "data").glob(f"*/{MANIFEST}"))
        assert [p for p in (fs / "data").rglob("*") if p.is_file()] == []  # no shard, no temporary left
        resize_tmpfs(fs, "4m")  # the operator frees space
        m = prepare(data, fs / "data", work=tmp_path / "work", **QUIET)
        assert m["reused"] is False and read_manifest(m["location"])["fingerprint"] == m["fingerprint"]


def test_a_damaged_unit_result_is_tokenized_again_never_trusted(tmp_path):
    jsonl_corpus(tmp_path / "corpus", files=1, per_file=80)
    data = spec([str(tmp_path / "corpus/*.jsonl")])
    prepare(data, tmp_path / "data", work=tmp_path / "work", **QUIET)
    units = sorted(p for p in (tmp_path / "work" / "units").iterdir())
    tokens = units[0] / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:-2])  # a torn write on a file system without atomic rename
    logged: list[str] = []
    other = data.model_copy(update={"shard_tokens": 1000})  # a new data set from the same units
    m = prepare(other, tmp_path / "data", work=tmp_path / "work", log=logged.append)
    assert any(line.startswith(f"tokenizing 1 of {len(units)} work unit") for line in logged), logged
    clean = prepare(other, tmp_path / "clean", work=tmp_path / "clean-work", **QUIET)
    assert data_set_bytes(m["location"]) == data_set_bytes(clean["location"])


@pytest.mark.parametrize(
    "make, eos, message",
    [
        (
            lambda p: p / "missing.json",
            "<|endoftext|>",
            r"tokenizer.path '.*missing.json' cannot be read .*fix the path",
        ),
        (
            lambda p: (p / "t.json").write_text("{not a tokenizer") and p / "t.json",
            "<|endoftext|>",
            r"is not a Hugging Face tokenizer.json",
        ),
        (
            lambda p: wide_tokenizer(p / "t.json", 1000),
            "</s>",
            r"has no token '</s>' to separate documents: set tokenizer.eos_token",
        ),
    ],
    ids=["missing", "not a tokenizer", "no separator"],
)
def test_a_given_tokenizer_that_cannot_serve_is_a_clear_error(tmp_path, make, eos, message):
    corpus = write_jsonl(tmp_path / "c.jsonl", docs(10))
    data = spec([str(corpus)], tokenizer={"path": str(make(tmp_path)), "eos_token": eos})
    with pytest.raises(DataPrepError, match=message):
        prepare(data, tmp_path / "data", work=tmp_path / "w", **QUIET)


def test_a_damaged_cached_tokenizer_is_trained_again(tmp_path):
    jsonl_corpus(tmp_path / "corpus", files=1, per_file=40)
    data = spec([str(tmp_path / "corpus/*.jsonl")])
    first = prepare(data, tmp_path / "data", work=tmp_path / "work", **QUIET)
    cached = tmp_path / "work" / "tokenizers" / f"{first['fingerprint']}.json"
    cached.write_bytes(cached.read_bytes()[:100])  # torn
    manifest = Path(first["location"]) / MANIFEST
    before = manifest.read_bytes()
    manifest.unlink()  # the data set is prepared again, from the cache
    logged: list[str] = []
    again = prepare(data, tmp_path / "data", work=tmp_path / "work", log=logged.append)
    assert any(f"{cached} is damaged; training the tokenizer again" in line for line in logged), logged
    assert again["reused"] is False and manifest.read_bytes() == before


def test_a_failing_progress_display_never_stops_preparation(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", docs(30))
    calls: list[str] = []

    def broken(p):
        calls.append(p.phase)
        raise ConnectionError("the Prefect server went away")

    logged: list[str] = []
    m = prepare(
        spec([str(tmp_path / "c.jsonl")]), tmp_path / "data", work=tmp_path / "w", log=logged.append, progress=broken
    )
    assert read_manifest(m["location"])["fingerprint"] == m["fingerprint"] and calls == ["scan"]
    assert [line for line in logged if "progress reporting failed" in line] == [
        "progress reporting failed (ConnectionError: the Prefect server went away); data preparation goes on without it"
    ]


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.unlink(),
        lambda p: p.write_bytes(p.read_bytes()[:-2]),
    ],
    ids=["shard deleted", "shard truncated"],
)
def test_a_data_set_with_a_missing_or_truncated_shard_is_prepared_again_not_reused(tmp_path, damage):
    jsonl_corpus(tmp_path / "corpus", files=1, per_file=60)
    data = spec([str(tmp_path / "corpus/*.jsonl")])
    first = prepare(data, tmp_path / "data", work=tmp_path / "work", **QUIET)
    before = data_set_bytes(first["location"])
    shard = Path(first["location"]) / first["splits"]["train"][0]["file"]
    damage(shard)
    logged: list[str] = []
    again = prepare(data, tmp_path / "data", work=tmp_path / "work", log=logged.append)
    assert again["reused"] is False and data_set_bytes(again["location"]) == before
    assert any(f"is damaged ({shard.name} " in line and "preparing it again" in line for line in logged), logged
