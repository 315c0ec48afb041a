"""Data preparation at scale (pretrain.data.prepare): versioned data sets, determinism across worker
counts, resuming after a kill, incremental re-runs, deduplication, weights, wide vocabularies and
every source format. Real files, real worker processes. Bad input and damaged files:
test_dataset_bad_input.py; an S3 root: test_dataset_s3.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
from tokenizers import Tokenizer

from pretrain.data.prepare.errors import DataPrepError
from pretrain.data.prepare.pipeline import prepare
from support.corpora import QUIET, data_set_bytes, docs, jsonl_corpus, spec, wide_tokenizer, write_jsonl
from trainer.common.atomic import sha256_file
from trainer.data.manifest import MANIFEST
from trainer.data.sampler import TokenWindows, read_manifest

ROOT = Path(__file__).resolve().parents[2]


def test_a_prepared_data_set_is_versioned_complete_and_reused_never_rewritten(tmp_path):
    data = spec(["{stdlib}/json/*.py"], tokenizer={"vocab_size": 400}, val_fraction=0.2)
    m = prepare(data, tmp_path / "data", work=tmp_path / "work", **QUIET)
    location = Path(m["location"])
    assert location == tmp_path / "data" / m["fingerprint"] and m["reused"] is False
    on_disk = read_manifest(location)
    assert on_disk["version"] == 2 and on_disk["fingerprint"] == m["fingerprint"] and on_disk["dtype"] == "uint16"
    for split, shards in on_disk["splits"].items():
        arr = np.concatenate([np.fromfile(location / s["file"], dtype=on_disk["dtype"]) for s in shards])
        assert len(arr) == on_disk["tokens"][split] > 0 and arr.max() < on_disk["vocab_size"]
        assert all(sha256_file(location / s["file"]) == s["sha256"] for s in shards)
    assert [s["uri"].rsplit("/", 1)[1] for s in on_disk["sources"]] == sorted(
        s["uri"].rsplit("/", 1)[1] for s in on_disk["sources"]
    )
    assert sum(s["documents"] for s in on_disk["sources"]) == sum(on_disk["documents"].values())
    tok = Tokenizer.from_file(str(location / on_disk["tokenizer"]))
    assert (
        tok.decode(tok.encode("def f(x):\n    return json.dumps(x)\n").ids) == "def f(x):\n    return json.dumps(x)\n"
    )
    assert len(TokenWindows(location, "train", 32)) > 0  # what training reads

    before = {p.name: p.stat().st_mtime_ns for p in location.iterdir()}
    again = prepare(data, tmp_path / "data", work=tmp_path / "work", **QUIET)
    assert again["reused"] is True and again["location"] == m["location"]
    assert {p.name: p.stat().st_mtime_ns for p in location.iterdir()} == before  # not rewritten

    changed = prepare(data.model_copy(update={"val_fraction": 0.3}), tmp_path / "data", work=tmp_path / "work", **QUIET)
    assert changed["fingerprint"] != m["fingerprint"] and Path(changed["location"]).parent == location.parent
    assert {p.name: p.stat().st_mtime_ns for p in location.iterdir()} == before  # the old set stays as it was


def test_the_data_set_is_byte_identical_for_any_number_of_workers(tmp_path):
    corpus = jsonl_corpus(tmp_path / "corpus")
    sets = []
    for workers in (1, 2):
        seen = []
        m = prepare(
            spec([str(tmp_path / "corpus/*.jsonl")], workers=workers),
            tmp_path / f"data{workers}",
            work=tmp_path / f"work{workers}",
            progress=seen.append,
            **QUIET,
        )
        units = sum(s["units"] for s in m["sources"])
        assert units > 2 * len(corpus)  # several units per file
        sets.append(data_set_bytes(m["location"]))
        tokenize = [p for p in seen if p.phase == "tokenize"]
        assert [p.units_done for p in tokenize] == list(range(1, units + 1))  # one report per finished unit
        assert [p.phase for p in seen if p.phase != "tokenize"] == ["scan", "tokenizer", "assemble", "done"]
        assert seen[-1].fraction == 1.0 and seen[-1].tokens == tokenize[-1].tokens > 0
    assert sets[0] == sets[1]


KILLED_RUN = """
import sys
from pathlib import Path
from pretrain.data.prepare.pipeline import prepare
from pretrain.spec.data import DataSpec

def stop_at_unit(p):
    if p.phase == "tokenize" and p.units_done == 3:
        print("UNITS", p.units_done, p.units_total, flush=True)
        sys.stdin.readline()  # held here until the test kills this process

if __name__ == "__main__":
    data = DataSpec.model_validate_json(sys.argv[1])
    prepare(data, sys.argv[2], work=Path(sys.argv[3]), log=lambda *_: None, progress=stop_at_unit)
"""


def test_a_run_killed_mid_preparation_resumes_at_unfinished_units_with_an_identical_manifest(tmp_path):
    jsonl_corpus(tmp_path / "corpus", files=2, per_file=120)
    data = spec([str(tmp_path / "corpus/*.jsonl")])
    script = tmp_path / "killed_run.py"
    script.write_text(KILLED_RUN)
    proc = subprocess.Popen(
        [sys.executable, str(script), data.model_dump_json(), str(tmp_path / "data"), str(tmp_path / "work")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,
    )
    try:
        line = proc.stdout.readline().split()
        assert line[:2] == ["UNITS", "3"], line
        total = int(line[2])
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the preparing process and its workers, at a unit boundary
        proc.wait()
    units = tmp_path / "work" / "units"
    finished = [p for p in units.iterdir() if not p.name.startswith(".")]
    assert 3 <= len(finished) < total
    assert not list((tmp_path / "data").glob(f"*/{MANIFEST}"))  # nothing half-written counts as a data set

    logged: list[str] = []
    resumed = prepare(data, tmp_path / "data", work=tmp_path / "work", log=logged.append)
    assert any("finished earlier are reused" in line and f"of {total} work unit" in line for line in logged), logged
    clean = prepare(data, tmp_path / "clean", work=tmp_path / "clean-work", **QUIET)
    assert resumed["fingerprint"] == clean["fingerprint"]
    assert data_set_bytes(resumed["location"]) == data_set_bytes(clean["location"])  # manifest and shards


def test_a_worker_that_dies_mid_preparation_is_a_clear_error_and_the_next_run_reuses_what_finished(tmp_path):
    """A tokenizing worker killed (as the kernel's OOM killer would) fails the run with what to
    lower; the units finished before it are kept, and the next run reuses them."""
    jsonl_corpus(tmp_path / "corpus", files=2, per_file=120)
    data = spec([str(tmp_path / "corpus/*.jsonl")], workers=2)
    killed = []

    def kill_a_worker(p):
        if p.phase == "tokenize" and p.units_done == 2 and not killed:
            servers = [c for c in psutil.Process().children() if "multiprocessing.forkserver" in " ".join(c.cmdline())]
            workers = [w for server in servers for w in server.children()]
            workers[0].kill()
            killed.append(workers[0].pid)

    with pytest.raises(DataPrepError, match="worker process died .*lower data.workers or data.unit_bytes"):
        prepare(data, tmp_path / "data", work=tmp_path / "work", log=lambda *_: None, progress=kill_a_worker)
    assert killed
    finished = [p for p in (tmp_path / "work" / "units").iterdir() if not p.name.startswith(".")]
    assert len(finished) >= 2
    logged: list[str] = []
    resumed = prepare(data, tmp_path / "data", work=tmp_path / "work", log=logged.append)
    assert any("finished earlier are reused" in line for line in logged), logged
    assert read_manifest(resumed["location"])["fingerprint"] == resumed["fingerprint"]


UNGUARDED = """
import sys
from pathlib import Path
from pretrain.data.prepare.pipeline import prepare
from pretrain.spec.data import DataSpec

prepare(DataSpec.model_validate_json(sys.argv[1]), sys.argv[2], work=Path(sys.argv[3]), log=lambda *_: None)
print("prepared")
"""


def test_a_script_without_a_main_check_is_told_to_add_one(tmp_path):
    """Python's multiprocessing runs the calling script again in each worker: a script that calls
    preparation at its top level makes every worker fail at its start. The error says so and how
    to fix it (not "out of memory")."""
    jsonl_corpus(tmp_path / "corpus", files=1, per_file=60)
    data = spec([str(tmp_path / "corpus/*.jsonl")], workers=2)
    script = tmp_path / "prep.py"
    script.write_text(UNGUARDED)
    proc = subprocess.run(
        [sys.executable, str(script), data.model_dump_json(), str(tmp_path / "data"), str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode != 0 and "prepared" not in proc.stdout
    # the script's own error (Python's resource tracker may warn about the broken pool's semaphores after it)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pretrain.data.prepare.errors.")]
    assert errors and errors[-1].startswith(
        "pretrain.data.prepare.errors.DataPrepError: the data preparation worker "
        "processes ended before they could start"
    ), proc.stderr[-2000:]
    last = errors[-1]
    assert str(script) in last and 'if __name__ == "__main__":' in last and "memory" not in last

    guarded = tmp_path / "guarded.py"
    guarded.write_text(
        UNGUARDED.replace("\nprepare(", '\nif __name__ == "__main__":\n    prepare(').replace(
            '\nprint("prepared")', '\n    print("prepared")'
        )
    )
    done = subprocess.run(
        [sys.executable, str(guarded), data.model_dump_json(), str(tmp_path / "data"), str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0 and done.stdout == "prepared\n", done.stderr[-2000:]


def test_with_a_given_tokenizer_a_changed_file_re_tokenizes_only_its_units(tmp_path):
    files = jsonl_corpus(tmp_path / "corpus", files=3, per_file=40)
    first = prepare(spec([str(tmp_path / "corpus/*.jsonl")]), tmp_path / "seed", work=tmp_path / "seedwork", **QUIET)
    tokenizer = Path(first["location"]) / "tokenizer.json"
    data = spec([str(tmp_path / "corpus/*.jsonl")], tokenizer={"path": str(tokenizer)})
    before = prepare(data, tmp_path / "data", work=tmp_path / "work", **QUIET)
    changed_units = next(s["units"] for s in before["sources"] if s["uri"] == str(files[1]))
    write_jsonl(files[1], docs(45, seed=1))  # the middle file changes (5 more documents)

    logged: list[str] = []
    after = prepare(data, tmp_path / "data", work=tmp_path / "work", log=logged.append)
    new_units = next(s["units"] for s in after["sources"] if s["uri"] == str(files[1]))
    total = sum(s["units"] for s in after["sources"])
    assert any(line.startswith(f"tokenizing {new_units} of {total} work unit") for line in logged), logged
    assert after["fingerprint"] != before["fingerprint"] and read_manifest(before["location"])  # old set intact
    assert after["documents"]["train"] + after["documents"]["val"] == sum(before["documents"].values()) + 5
    assert changed_units and after["tokenizer_sha256"] == before["tokenizer_sha256"]
    assert len(list((tmp_path / "work" / "units").iterdir())) == total  # the changed file's old units are gone


def test_a_trained_tokenizer_says_a_changed_corpus_re_tokenizes_everything(tmp_path):
    files = jsonl_corpus(tmp_path / "corpus", files=2, per_file=30)
    data = spec([str(tmp_path / "corpus/*.jsonl")])
    prepare(data, tmp_path / "data", work=tmp_path / "work", **QUIET)
    write_jsonl(files[0], docs(31, seed=0))
    logged: list[str] = []
    prepare(data, tmp_path / "data", work=tmp_path / "work", log=logged.append)
    assert any("trained on a sample of the corpus" in line and "tokenizer.path" in line for line in logged), logged


def test_exact_duplicate_documents_are_dropped_first_wins_and_counted(tmp_path):
    texts = docs(50)
    a = write_jsonl(tmp_path / "a.jsonl", texts + texts[:5])  # 5 repeated within the file
    b = write_jsonl(tmp_path / "b.jsonl", texts[10:30] + docs(10, seed=9))  # 20 seen in a.jsonl
    m = prepare(spec([str(a), str(b)]), tmp_path / "data", work=tmp_path / "work", **QUIET)
    by_uri = {s["uri"]: s for s in m["sources"]}
    assert by_uri[str(a)]["skipped"]["duplicate"] == 5 and by_uri[str(a)]["documents"] == 50
    assert by_uri[str(b)]["skipped"]["duplicate"] == 20 and by_uri[str(b)]["documents"] == 10
    assert m["skipped"]["duplicate"] == 25 and sum(m["documents"].values()) == 60


@pytest.mark.parametrize("weight, low, high", [(2.0, 2.0, 2.0), (3.0, 3.0, 3.0), (0.5, 0.3, 0.7), (1.5, 1.3, 1.7)])
def test_a_source_weight_repeats_its_train_documents_and_never_its_val_documents(tmp_path, weight, low, high):
    texts = docs(200)
    corpus = write_jsonl(tmp_path / "c.jsonl", texts)
    base = prepare(spec([str(corpus)]), tmp_path / "base", work=tmp_path / "w", **QUIET)
    weighted = prepare(
        spec([{"path": str(corpus), "weight": weight}]), tmp_path / "weighted", work=tmp_path / "w", **QUIET
    )
    assert (
        weighted["tokens"]["val"] == base["tokens"]["val"] and weighted["documents"]["val"] == base["documents"]["val"]
    )
    assert low <= weighted["tokens"]["train"] / base["tokens"]["train"] <= high
    again = prepare(spec([{"path": str(corpus), "weight": weight}]), tmp_path / "again", work=tmp_path / "w2", **QUIET)
    assert data_set_bytes(again["location"]) == data_set_bytes(weighted["location"])  # the chosen share is fixed


def test_a_vocabulary_above_65536_gives_uint32_shards_with_the_separator_intact(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", docs(20))
    tokenizer = wide_tokenizer(tmp_path / "wide.json")
    m = prepare(
        spec([str(corpus)], tokenizer={"path": str(tokenizer)}), tmp_path / "data", work=tmp_path / "w", **QUIET
    )
    assert m["dtype"] == "uint32" and m["vocab_size"] == 70_000 and m["eot_id"] == 69_999
    tokens = np.fromfile(Path(m["location"]) / m["splits"]["train"][0]["file"], dtype="uint32")
    assert (tokens == 69_999).sum() == m["documents"]["train"] and tokens[-1] == 69_999
    assert len(TokenWindows(m["location"], "train", 16)) > 0


def test_every_source_format_yields_the_same_documents(tmp_path):
    """The same documents as JSONL, JSONL.gz, JSONL.zst and Parquet: every copy after the first is
    an exact duplicate, so each format read every document, and read it identically."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    texts = docs(40)
    plain = write_jsonl(tmp_path / "a.jsonl", texts)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes()))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    pq.write_table(pa.table({"body": texts}), tmp_path / "d.parquet", row_group_size=7)
    m = prepare(
        spec(
            [
                str(plain),
                str(tmp_path / "b.jsonl.gz"),
                str(tmp_path / "c.jsonl.zst"),
                {"path": str(tmp_path / "d.parquet"), "text_field": "body"},
            ],
            workers=2,
        ),
        tmp_path / "data",
        work=tmp_path / "w",
        **QUIET,
    )
    assert [(s["format"], s["documents"], s["skipped"]["duplicate"]) for s in m["sources"]] == [
        ("jsonl", 40, 0),
        ("jsonl", 0, 40),
        ("jsonl", 0, 40),
        ("parquet", 0, 40),
    ]


@pytest.mark.parametrize(
    "batches",
    [
        [[5, 3, 5, 1], [3, 7, 7], [], [1, 2, 3, 4, 5, 6, 7, 8]],
        [[2**64 - 1, 0, 2**64 - 1], [0]],
        [list(range(i, i + 50)) for i in range(0, 1000, 30)],  # overlapping runs: many merges
        [list(np.random.default_rng(3).integers(0, 400, size=97)) for _ in range(40)],
    ],
    ids=["small", "extremes", "overlapping", "random"],
)
def test_the_dedup_hash_set_agrees_with_a_python_set(batches):
    from pretrain.data.prepare.dedup import HashSet

    hs, reference = HashSet(), set()
    for batch in batches:
        expected = []
        for h in batch:
            expected.append(int(h) not in reference)
            reference.add(int(h))
        assert hs.first_seen(np.asarray(batch, dtype=np.uint64)).tolist() == expected
        assert len(hs) == len(reference)
    sizes = [len(b) for b in hs.blocks]
    assert sizes == sorted(sizes, reverse=True)
