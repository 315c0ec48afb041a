"""pretrain.data.corpus: expanding sources into files, cutting files into work units, reading units
into documents; each format on the local disk (S3 in test_corpus_s3.py; compressed files and
Parquet in test_corpus_compressed_and_parquet.py), and every bad input that is about reading."""

from __future__ import annotations

import json
import os
import random
import sysconfig
from pathlib import Path

import pytest

from pretrain.data.corpus import CorpusError, expand_sources, plan_units, read_unit, resolve_format
from pretrain.data.corpus.globs import glob_regex
from pretrain.data.corpus.units import batch_row_groups, byte_ranges
from support.corpus_files import compress, read_all, skips, spec, texts, write_jsonl

# ---- formats and globs (pure) ----


@pytest.mark.parametrize(
    "name, declared, expected",
    [
        ("a.txt", "auto", ("text", "")),
        ("a.py", "auto", ("text", "")),
        ("a.jsonl", "auto", ("jsonl", "")),
        ("a.NDJSON", "auto", ("jsonl", "")),
        ("a.json", "auto", ("jsonl", "")),
        ("a.jsonl.gz", "auto", ("jsonl", "gz")),
        ("a.jsonl.zst", "auto", ("jsonl", "zst")),
        ("a.txt.gz", "auto", ("text", "gz")),
        ("a.parquet", "auto", ("parquet", "")),
        ("s3://b/x/a.parquet", "auto", ("parquet", "")),
        ("a.log", "jsonl", ("jsonl", "")),
        ("a.jsonl.zst", "text", ("text", "zst")),
        ("data.gz.txt", "auto", ("text", "")),
    ],
)
def test_format_follows_the_extension_unless_declared(name, declared, expected):
    assert resolve_format(name, declared) == expected


@pytest.mark.parametrize(
    "pattern, path, matches",
    [
        ("corpus/**.jsonl", "corpus/a.jsonl", True),
        ("corpus/**.jsonl", "corpus/x/y/a.jsonl", True),
        ("corpus/**.jsonl", "corpus/a.jsonl.gz", False),
        ("corpus/**/*.jsonl", "corpus/a.jsonl", True),
        ("corpus/**/*.jsonl", "corpus/d/a.jsonl", True),
        ("corpus/*.jsonl", "corpus/d/a.jsonl", False),
        ("corpus/?.txt", "corpus/a.txt", True),
        ("corpus/?.txt", "corpus/ab.txt", False),
        ("corpus/[ab].txt", "corpus/b.txt", True),
        ("corpus/[!ab].txt", "corpus/b.txt", False),
        ("corpus/[!ab].txt", "corpus/c.txt", True),
        ("c+p/(x).txt", "c+p/(x).txt", True),
        ("corpus/**", "corpus/x/y", True),
    ],
)
def test_glob_rules(pattern, path, matches):
    assert bool(glob_regex(pattern).match(path)) is matches


# ---- expanding sources ----


def test_groups_entries_and_matches_keep_their_order_and_a_file_named_twice_is_kept_once(tmp_path):
    for name in ("b.txt", "a.txt", "c.jsonl"):
        (tmp_path / name).write_text("x\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.txt").write_text("x\n")
    data = spec(
        {
            "web": [str(tmp_path / "c.jsonl"), str(tmp_path / "*.txt"), str(tmp_path / "a.txt")],
            "code": [{"path": str(tmp_path / "**.txt"), "weight": 2.0}],
        }
    )
    groups = expand_sources(data)
    assert list(groups) == ["web", "code"]
    assert [Path(f.uri).name for f in groups["web"]] == ["c.jsonl", "a.txt", "b.txt"]
    assert [(Path(f.uri).name, f.format, f.weight, f.group) for f in groups["code"]] == [
        ("a.txt", "text", 2.0, "code"),
        ("b.txt", "text", 2.0, "code"),
        ("d.txt", "text", 2.0, "code"),
    ]
    assert groups["web"][0].entry == "data.sources.web[0]"


def test_a_directory_is_every_file_under_it_and_stdlib_expands(tmp_path):
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "e" / "x.txt").write_text("x")
    (tmp_path / "d" / ".hidden").write_text("x")
    assert [f.uri for f in expand_sources(spec([str(tmp_path / "d")]))["all"]] == [str(tmp_path / "d" / "e" / "x.txt")]
    json_dir = Path(sysconfig.get_paths()["stdlib"]) / "json"
    files = expand_sources(spec(["{stdlib}/json/*.py"]))["all"]
    assert [f.uri for f in files] == sorted(str(p) for p in json_dir.glob("*.py"))


def test_max_bytes_takes_whole_files_per_group(tmp_path):
    for i in range(4):
        (tmp_path / f"{i}.txt").write_text("x" * 100)
    groups = expand_sources(spec({"a": [str(tmp_path / "*.txt")], "b": [str(tmp_path / "3.txt")]}, max_bytes=150))
    assert [Path(f.uri).name for f in groups["a"]] == ["0.txt", "1.txt"]
    assert [Path(f.uri).name for f in groups["b"]] == ["3.txt"]


def test_the_identity_changes_with_the_file(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("one")
    before = expand_sources(spec([str(path)]))["all"][0]
    path.write_text("two!")
    after = expand_sources(spec([str(path)]))["all"][0]
    assert before.identity != after.identity and after.size == 4
    assert plan_units(before, 4096)[0].key != plan_units(after, 4096)[0].key


@pytest.mark.parametrize(
    "sources, field",
    [
        (["{missing}/nothing/*.txt"], "data.sources[0]"),
        (["{stdlib}/json/*.py", "/nonexistent/dir/*.jsonl"], "data.sources[1]"),
        ({"web": ["{stdlib}/json/*.py"], "code": ["/nonexistent/x.py"]}, "data.sources.code[0]"),
    ],
)
def test_an_entry_matching_nothing_is_named(sources, field):
    with pytest.raises(
        CorpusError, match=rf"^{field.replace('[', '.').replace(']', '.')} .*matched no files: fix the path"
    ):
        expand_sources(spec(sources))


# ---- work units ----


@pytest.mark.parametrize(
    "size, unit, expected",
    [
        (0, 10, [(0, 0)]),
        (10, 10, [(0, 10)]),
        (11, 10, [(0, 10), (10, 11)]),
        (25, 10, [(0, 10), (10, 20), (20, 25)]),
    ],
)
def test_byte_ranges(size, unit, expected):
    assert byte_ranges(size, unit) == expected


@pytest.mark.parametrize(
    "sizes, unit, expected",
    [
        ([], 10, []),
        ([4, 4, 4], 10, [(0, 3)]),
        ([6, 6, 6], 10, [(0, 2), (2, 3)]),
        ([20, 1, 20], 10, [(0, 1), (1, 3)]),
    ],
)
def test_row_groups_are_batched_to_about_unit_bytes(sizes, unit, expected):
    assert batch_row_groups(sizes, unit) == expected


def test_every_jsonl_line_is_read_exactly_once_whatever_the_unit_size(tmp_path):
    rng = random.Random(0)
    records = ["".join(rng.choice('abc é\n\t{}"') for _ in range(rng.randrange(1, 40))) for _ in range(60)]
    path = write_jsonl(tmp_path / "c.jsonl", records)
    data = spec([str(path)])
    for unit_bytes in (1, 2, 3, 7, 16, 50, 64, 333, path.stat().st_size, 10**6):
        assert texts(read_all(data, unit_bytes)) == records, unit_bytes


def test_a_large_text_file_splits_after_newlines_and_loses_nothing(tmp_path):
    rng = random.Random(1)
    content = "".join("x" * rng.randrange(1, 30) + "\n" for _ in range(200)) + "tail without newline"
    path = tmp_path / "big.txt"
    path.write_text(content)
    data = spec([str(path)])
    for unit_bytes in (1, 5, 64, 1000, len(content), len(content) + 1):
        docs = read_all(data, unit_bytes)
        assert "".join(texts(docs)) == content, unit_bytes
        assert all(t.endswith("\n") for t in texts(docs)[:-1])
    assert texts(read_all(data, 10**6)) == [content]  # a text file within unit_bytes is one document


# ---- bad input ----


def test_a_bad_jsonl_line_stops_with_file_and_line_number_even_in_a_later_unit(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(50)) + "{oops\n")
    with pytest.raises(
        CorpusError,
        match=rf"{path} \(from data.sources\[0\]\): line 51: not JSON .*"
        "set data.on_bad_record: skip",
    ):
        read_all(spec([str(path)]), unit_bytes=64)


@pytest.mark.parametrize(
    "line, problem",
    [
        ("not json", "not JSON"),
        ("[1, 2]", "a JSON list, not an object"),
        ('{"body": "x", "id": 3}', "no field 'text' \\(its fields: 'body', 'id'\\)"),
        ('{"text": 42}', "field 'text' is int, not a string"),
        ('{"text": null}', "field 'text' is NoneType"),
        ("[" * 100000, "not JSON"),
    ],
)
def test_bad_records_error_or_are_skipped_and_counted(tmp_path, line, problem):
    path = tmp_path / "c.jsonl"
    path.write_text(f'{{"text": "good one"}}\n{line}\n{{"text": "good two"}}\n')
    with pytest.raises(CorpusError, match=f"line 2: {problem}"):
        read_all(spec([str(path)]))
    items = read_all(spec([str(path)], on_bad_record="skip"))
    assert texts(items) == ["good one", "good two"]
    assert skips(items) == [("bad_record", f"{path} line 2")]


def test_empty_documents_are_skipped_and_blank_lines_ignored(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n\n   \n{"text": "  \\n "}\n{"text": ""}\n{"text": "b"}\n')
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n \n")
    items = read_all(spec([str(path), str(empty), str(blank)]))
    assert texts(items) == ["a", "b"]
    assert skips(items) == [
        ("empty", f"{path} line 4"),
        ("empty", f"{path} line 5"),
        ("empty", str(empty)),
        ("empty", str(blank)),
    ]


def test_binary_files_are_skipped_whole_and_counted_once(tmp_path):
    nul = tmp_path / "a.bin"
    nul.write_bytes(b"ELF\x00\x01" + b"x\n" * 5000)
    noise = tmp_path / "b.dat"
    noise.write_bytes(bytes(random.Random(2).randrange(128, 256) for _ in range(3000)))
    good = tmp_path / "c.txt"
    good.write_text("fine\n")
    fake = tmp_path / "d.jsonl"
    fake.write_bytes(b"\x00\x00PK" * 100)
    items = read_all(spec([str(nul), str(noise), str(good), str(fake)]), unit_bytes=1000)
    assert texts(items) == ["fine\n"]
    assert skips(items) == [("binary", str(nul)), ("binary", str(noise)), ("binary", str(fake))]


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("replace", (["caf\ufffd ok\n"], [])),
        ("skip", ([], [("decode", "FILE")])),
    ],
)
def test_isolated_invalid_bytes_follow_decode_errors(tmp_path, mode, expected):
    text = tmp_path / "a.txt"
    text.write_bytes(b"caf\xe9 ok\n")
    lines = tmp_path / "b.jsonl"
    lines.write_bytes(b'{"text": "caf\xe9 ok\\n"}\n')
    for path, where in ((text, str(text)), (lines, f"{lines} line 1")):
        items = read_all(spec([str(path)], decode_errors=mode, binary_threshold=0.5))
        assert (texts(items), skips(items)) == (expected[0], [(r, where) for r, _ in expected[1]])
    for path, where in ((text, f"{text}"), (lines, "line 1")):
        with pytest.raises(CorpusError, match=f"{where}.*invalid UTF-8 .*set data.decode_errors: replace"):
            read_all(spec([str(path)], decode_errors="error", binary_threshold=0.5))


def test_lone_surrogate_escapes_in_json_are_invalid_text(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "bad \\ud800 here"}\n{"text": "ok \\u00e9"}\n')
    assert texts(read_all(spec([str(path)]))) == ["bad \ufffd here", "ok é"]
    assert skips(read_all(spec([str(path)], decode_errors="skip"))) == [("decode", f"{path} line 1")]


def test_a_file_changed_or_removed_after_listing_is_an_error_naming_it(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ["one", "two"])
    data = spec([str(path)])
    unit = plan_units(expand_sources(data)["all"][0], 4096)[0]
    write_jsonl(path, ["one", "two", "three"])
    with pytest.raises(CorpusError, match=f"{path} .*changed while the corpus was being prepared.*run again"):
        list(read_unit(unit, data))
    os.unlink(path)
    with pytest.raises(CorpusError, match=f"{path} .*no longer exists: restore it"):
        list(read_unit(unit, data))


def test_a_utf8_byte_order_mark_is_not_part_of_the_first_document(tmp_path):
    lines = tmp_path / "a.jsonl"
    lines.write_bytes(b'\xef\xbb\xbf{"text": "first"}\r\n{"text": "second"}\r\n')
    text = tmp_path / "b.txt"
    text.write_bytes(b"\xef\xbb\xbfhello\n")
    assert texts(read_all(spec([str(lines), str(text)]))) == ["first", "second", "hello\n"]


def test_a_line_longer_than_several_units_is_read_once_and_whole(tmp_path):
    records = ["short", "y" * (3 << 20), "after"]  # the long line spans units it does not start in
    path = write_jsonl(tmp_path / "long.jsonl", records)
    for unit_bytes in (1 << 20, 10**7):
        assert texts(read_all(spec([str(path)]), unit_bytes)) == records


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="needs Linux /proc")
def test_an_unreadable_file_is_an_error_naming_it_and_its_entry():
    data = spec(["{stdlib}/json/__init__.py", "/proc/self/mem"])  # listed as a file; reading it fails (EIO)
    with pytest.raises(
        CorpusError,
        match=r"^/proc/self/mem \(from data.sources\[1\]\) is unreadable \(OSError: .*\); "
        "replace or fix the file, or remove it from data.sources",
    ):
        read_all(data)


def test_a_unit_key_changes_when_what_the_unit_yields_can_change(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("".join(f"line {i}\n" for i in range(500)))
    packed = expand_sources(spec([str(compress(text, "gz"))]))["all"][0]
    # one unit either way, but cut into documents every unit_bytes: its key follows
    assert plan_units(packed, 4096)[0].key != plan_units(packed, 8192)[0].key
    plain = expand_sources(spec([str(text)]))["all"][0]
    assert plan_units(plain, 4096)[0].key == plan_units(plain, 4096)[0].key
    assert plan_units(plain, 4096)[0].key != plan_units(plain, 2048)[0].key
