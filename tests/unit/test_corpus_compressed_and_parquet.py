"""pretrain.data.corpus on compressed files (gzip, zstd) and Parquet on the local disk: read as
the plain files are, planned by row groups, and every damaged or unsuitable one an error naming it
(the other formats and bad input: test_corpus.py)."""

from __future__ import annotations

import pytest

from pretrain.data.corpus import CorpusError, expand_sources, plan_units
from support.corpus_files import compress, read_all, skips, spec, texts, write_jsonl, write_parquet


@pytest.mark.parametrize("kind", ["gz", "zst"])
def test_compressed_files_read_like_the_plain_ones(tmp_path, kind):
    records = [f"document {i} " + "é" * (i % 5) for i in range(40)]
    plain = write_jsonl(tmp_path / "c.jsonl", records)
    packed = compress(plain, kind)
    units = plan_units(expand_sources(spec([str(packed)]))["all"][0], 64)
    assert len(units) == 1  # a compressed file cannot be entered in the middle
    assert texts(read_all(spec([str(packed)]), 64)) == records
    text = tmp_path / "t.txt"
    text.write_text("".join(f"line {i}\n" for i in range(500)))
    for unit_bytes in (4096, 100, 10**6):  # cut every unit_bytes as the plain file's units are
        assert texts(read_all(spec([str(compress(text, kind))]), unit_bytes)) == texts(
            read_all(spec([str(text)]), unit_bytes)
        )


@pytest.mark.parametrize("kind", ["gz", "zst"])
def test_a_damaged_compressed_file_is_an_error_naming_it(tmp_path, kind):
    packed = compress(write_jsonl(tmp_path / "c.jsonl", [f"doc {i}" for i in range(2000)]), kind)
    packed.write_bytes(packed.read_bytes()[: packed.stat().st_size // 2])  # truncated
    with pytest.raises(CorpusError, match=f"{packed} .*is a damaged {kind} file .*replace or fix the file"):
        read_all(spec([str(packed)]))
    packed.write_bytes(b"not compressed at all\n" * 10)
    with pytest.raises(CorpusError, match=f"{packed} .*damaged {kind} file"):
        read_all(spec([str(packed)]))


def test_parquet_rows_are_documents_planned_by_row_groups(tmp_path):
    values = [f"row {i} " + "x" * i for i in range(20)]
    path = write_parquet(tmp_path / "a.parquet", values, row_group_size=3, id=list(range(20)))
    source = expand_sources(spec([str(path)]))["all"][0]
    assert source.format == "parquet"
    assert [(u.start, u.stop) for u in plan_units(source, 1)] == [(i, i + 1) for i in range(7)]
    assert len(plan_units(source, 10**9)) == 1
    for unit_bytes in (1, 100, 10**9):
        assert texts(read_all(spec([str(path)]), unit_bytes)) == values


def test_parquet_nulls_empties_and_binary_columns(tmp_path):
    path = write_parquet(tmp_path / "a.parquet", ["a", None, "", "b"], column="body")
    with pytest.raises(CorpusError, match="row group 0 row 1: column 'body' is null"):
        read_all(spec([{"path": str(path), "text_field": "body"}]))
    items = read_all(spec([{"path": str(path), "text_field": "body"}], on_bad_record="skip"))
    assert texts(items) == ["a", "b"]
    assert skips(items) == [("bad_record", f"{path} row group 0 row 1"), ("empty", f"{path} row group 0 row 2")]
    raw = write_parquet(tmp_path / "b.parquet", [b"caf\xc3\xa9", b"caf\xe9" + b" ok" * 50, b"\x00\x01\x02"])
    items = read_all(spec([str(raw)]))
    assert texts(items) == ["café", "caf\ufffd" + " ok" * 50]
    assert skips(items) == [("binary", f"{raw} row group 0 row 2")]


def test_parquet_without_the_text_column_or_damaged_is_an_error_naming_it(tmp_path):
    path = write_parquet(tmp_path / "a.parquet", ["x"], column="content")
    with pytest.raises(
        CorpusError,
        match=r"a.parquet \(from data.sources\[0\]\) has no column 'text' "
        r"\(its columns: 'content'\); set text_field",
    ):
        read_all(spec([str(path)]))
    numbers = write_parquet(tmp_path / "n.parquet", [1, 2], column="text")
    with pytest.raises(CorpusError, match="column 'text' holds int64, not text"):
        read_all(spec([str(numbers)]))
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(CorpusError, match=f"{bad} .*is not a readable Parquet file"):
        read_all(spec([str(bad)]))
    with pytest.raises(CorpusError, match="compressed Parquet"):
        expand_sources(spec([str(compress(path, "gz"))]))


def test_a_zstd_file_of_several_frames_reads_whole(tmp_path):
    import zstandard

    path = tmp_path / "multi.jsonl.zst"
    parts = [
        write_jsonl(tmp_path / f"p{i}.jsonl", [f"part {i} doc {j}" for j in range(5)]).read_bytes() for i in range(3)
    ]
    path.write_bytes(b"".join(zstandard.ZstdCompressor().compress(p) for p in parts))
    assert texts(read_all(spec([str(path)]))) == [f"part {i} doc {j}" for i in range(3) for j in range(5)]
