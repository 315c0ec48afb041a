"""The node-local data cache (trainer.data.cache): a data set on S3 (SeaweedFS, signatures
checked) is fetched into ``<cache>/<fingerprint>/`` verified, reused, and repaired."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from support import s3_servers
from support.s3_servers import ACCESS_KEY, BUCKET, SECRET_KEY
from trainer.data.cache import local_data_dir
from trainer.data.sampler import DataError, TokenWindows
from trainer.storage import StorageError, open_storage

seaweed, seaweed_factory = s3_servers.seaweed, s3_servers.seaweed_factory


def write_data_set(root: Path, fingerprint: str = "fp0123456789abcd") -> Path:
    """A small v2 data set (two train shards, one val shard, a tokenizer) in ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    splits = {}
    for split, sizes in (("train", [300, 200]), ("val", [150])):
        splits[split] = []
        for i, n in enumerate(sizes):
            data = rng.integers(0, 500, n, dtype=np.uint16).tobytes()
            name = f"{split}_{i:05d}.bin"
            (root / name).write_bytes(data)
            splits[split].append(
                {"file": name, "tokens": n, "sha256": hashlib.sha256(data).hexdigest(), "group": "all"}
            )
    tokenizer = b'{"model": "a tokenizer"}'
    (root / "tokenizer.json").write_bytes(tokenizer)
    manifest = {
        "version": 2,
        "fingerprint": fingerprint,
        "dtype": "uint16",
        "vocab_size": 512,
        "eot_id": 0,
        "tokenizer": "tokenizer.json",
        "tokenizer_sha256": hashlib.sha256(tokenizer).hexdigest(),
        "splits": splits,
        "sources": [],
        "settings": {},
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


@pytest.fixture
def s3_options(seaweed) -> dict:
    return {"endpoint_url": seaweed.endpoint, "region": "us-east-1", "access_key": ACCESS_KEY, "secret_key": SECRET_KEY}


@pytest.fixture
def on_s3(tmp_path, s3_options) -> tuple[str, Path]:
    """(URL, local original) of a data set uploaded to SeaweedFS."""
    src = write_data_set(tmp_path / "src")
    url = f"s3://{BUCKET}/datasets/{uuid.uuid4().hex[:8]}/fp0123456789abcd"
    store = open_storage(url, **s3_options)
    for f in sorted(src.iterdir()):
        if f.name != "manifest.json":
            store.put_file(f.name, f)
    store.put_file("manifest.json", src / "manifest.json")  # last, as preparation does
    return url, src


def test_a_fresh_cache_fetches_and_verifies_the_data_set(tmp_path, on_s3, s3_options):
    url, src = on_s3
    local = local_data_dir(url, tmp_path / "cache", s3_options)

    assert local == tmp_path / "cache" / "fp0123456789abcd"
    assert {f.name: f.read_bytes() for f in local.iterdir() if not f.name.startswith(".")} == {
        f.name: f.read_bytes() for f in src.iterdir()
    }
    assert len(TokenWindows(local, "train", 32)) == (299 // 32) + (199 // 32)  # workers memory-map it


def test_a_second_call_reuses_the_cache_and_a_damaged_shard_is_fetched_again(tmp_path, on_s3, s3_options):
    url, src = on_s3
    cache = tmp_path / "cache"
    local = local_data_dir(url, cache, s3_options)
    inodes = {f.name: f.stat().st_ino for f in local.iterdir()}

    assert local_data_dir(url, cache, s3_options) == local  # a restart: nothing fetched again
    assert {f.name: f.stat().st_ino for f in local.iterdir()} == inodes

    shard = local / "train_00001.bin"
    damaged = bytearray(shard.read_bytes())
    damaged[10] ^= 0xFF
    shard.write_bytes(bytes(damaged))
    local_data_dir(url, cache, s3_options)
    assert shard.read_bytes() == (src / "train_00001.bin").read_bytes()  # repaired from S3
    assert (local / "train_00000.bin").stat().st_ino == inodes["train_00000.bin"]  # the others kept


def test_only_the_splits_asked_for_are_fetched(tmp_path, on_s3, s3_options):
    url, _ = on_s3
    local = local_data_dir(url, tmp_path / "cache", s3_options, splits=["val"])  # the gate / eval
    assert sorted(f.name for f in local.iterdir() if not f.name.startswith(".")) == [
        "manifest.json",
        "tokenizer.json",
        "val_00000.bin",
    ]


def test_a_partly_fetched_file_left_by_a_killed_fetcher_is_never_used(tmp_path, on_s3, s3_options):
    url, src = on_s3
    local = tmp_path / "cache" / "fp0123456789abcd"
    local.mkdir(parents=True)
    (local / ".val_00000.bin.part-123-abcd").write_bytes(b"half")  # what a SIGKILL mid-download leaves
    local_data_dir(url, tmp_path / "cache", s3_options)
    assert (local / "val_00000.bin").read_bytes() == (src / "val_00000.bin").read_bytes()
    assert not list(local.glob(".*.part-*"))


@pytest.mark.parametrize(
    "case, match",
    [
        ("no data set", r"no data set at s3://.*: prepare it first"),
        (
            "damaged object",
            r"train_00000\.bin does not match the sha256 its manifest records "
            r".*delete it and run data preparation again",
        ),
        ("other fingerprint", r"has fingerprint fp0123456789abcd, but this job was built for data set ffff"),
    ],
)
def test_a_data_set_that_cannot_be_used_is_a_clear_error(tmp_path, on_s3, s3_options, case, match):
    url, _ = on_s3
    kwargs = {}
    if case == "no data set":
        url = url.rsplit("/", 1)[0] + "/nothing-here"
    elif case == "damaged object":
        open_storage(url, **s3_options).put_bytes("train_00000.bin", b"\x00" * 600)
    else:
        kwargs["fingerprint"] = "ffff"
    with pytest.raises(DataError, match=match):
        local_data_dir(url, tmp_path / "cache", s3_options, **kwargs)
    assert not list((tmp_path / "cache").rglob("train_00000.bin"))  # nothing unverified is left to read


def test_a_local_data_set_is_used_where_it_is(tmp_path):
    src = write_data_set(tmp_path / "data")
    assert local_data_dir(str(src), tmp_path / "cache") == src and not (tmp_path / "cache").exists()
    with pytest.raises(DataError, match="built for data set other"):
        local_data_dir(str(src), tmp_path / "cache", fingerprint="other")


def test_while_s3_is_away_a_complete_cached_copy_still_trains(tmp_path, seaweed_factory):
    server = seaweed_factory()
    options = {
        "endpoint_url": server.endpoint,
        "region": "us-east-1",
        "access_key": ACCESS_KEY,
        "secret_key": SECRET_KEY,
        "max_attempts": 1,
    }
    src = write_data_set(tmp_path / "src")
    url = f"s3://{BUCKET}/datasets/fp0123456789abcd"
    store = open_storage(url, **options)
    for f in sorted(src.iterdir(), key=lambda f: f.name == "manifest.json"):
        store.put_file(f.name, f)
    cache = tmp_path / "cache"
    local = local_data_dir(url, cache, options, splits=["train"], fingerprint="fp0123456789abcd")
    server.stop()

    assert local_data_dir(url, cache, options, splits=["train"], fingerprint="fp0123456789abcd") == local  # a restart
    with pytest.raises(StorageError):  # what is not cached (the val split) cannot be had
        local_data_dir(url, cache, options, splits=["val"], fingerprint="fp0123456789abcd")
    (local / "train_00000.bin").write_bytes(b"\x00" * 600)  # nor a cached copy that is no longer intact
    with pytest.raises(StorageError):
        local_data_dir(url, cache, options, splits=["train"], fingerprint="fp0123456789abcd")


def test_the_ranks_of_a_node_fetching_at_once_share_one_verified_copy(tmp_path, on_s3, s3_options):
    """Two processes (the local ranks of one node) start on an empty cache together: the lock
    lets one fetch while the other waits, then both read the same complete copy."""
    url, src = on_s3
    code = (
        "import json, sys; from trainer.data.cache import local_data_dir; "
        "print(local_data_dir(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), session='job-1'))"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", code, url, str(tmp_path / "cache"), json.dumps(s3_options)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], [err for _, err in outs]
    local = Path(outs[0][0].strip())
    assert {out.strip() for out, _ in outs} == {str(local)}
    assert {f.name: f.read_bytes() for f in local.iterdir() if not f.name.startswith(".")} == {
        f.name: f.read_bytes() for f in src.iterdir()
    }
    assert not list(local.glob(".*.part-*"))
