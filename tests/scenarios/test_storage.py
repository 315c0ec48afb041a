"""Storage contract on a local directory and on real S3 servers (SeaweedFS, moto) on 127.0.0.1.

The S3 servers are real processes: SeaweedFS checks request signatures, and the fault tests
kill a server (SIGKILL) from inside a multipart upload.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
import uuid
from pathlib import Path

import pytest

from support import s3_servers
from support.s3_servers import ACCESS_KEY, BUCKET, SECRET_KEY
from trainer.storage import (
    LocalStorage,
    NotAFile,
    NotFound,
    StorageError,
    StorageUnreachable,
    open_storage,
)
from trainer.storage.s3 import S3Storage

# Fixtures: one SeaweedFS for the session's contract tests; private servers for fault tests.
seaweed, seaweed_factory = s3_servers.seaweed, s3_servers.seaweed_factory
moto_factory = s3_servers.moto_factory

MiB = 1 << 20
SMALL_PARTS = {"multipart_threshold": 5 * MiB, "multipart_chunksize": 5 * MiB}  # S3 minimum


def s3_storage(endpoint: str, prefix: str | None = None, **kw) -> S3Storage:
    opts = {
        "endpoint_url": endpoint,
        "region": "us-east-1",
        "access_key": ACCESS_KEY,
        "secret_key": SECRET_KEY,
        **SMALL_PARTS,
        **kw,
    }
    return S3Storage(BUCKET, prefix if prefix is not None else f"t/{uuid.uuid4().hex[:12]}", **opts)


@pytest.fixture(params=["local", "seaweedfs"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStorage(tmp_path / "root")
    return s3_storage(request.getfixturevalue("seaweed").endpoint)


def _big_file(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


# --- contract: both backends -------------------------------------------------------------


def test_bytes_round_trip_and_overwrite(store):
    store.put_bytes("a/b/c.bin", b"v1")
    assert store.get_bytes("a/b/c.bin") == b"v1"
    store.put_bytes("a/b/c.bin", b"version two")
    assert store.get_bytes("a/b/c.bin") == b"version two"
    assert store.size("a/b/c.bin") == 11
    store.put_bytes("empty", b"")
    assert store.get_bytes("empty") == b"" and store.size("empty") == 0


def test_multipart_file_round_trip(store, tmp_path):
    data = _big_file(tmp_path / "big.bin", 6 * MiB + 123)  # > threshold: two parts on S3
    store.put_file("ckpt/model.pt", tmp_path / "big.bin")
    assert store.size("ckpt/model.pt") == len(data)
    out = tmp_path / "out" / "model.pt"
    out.parent.mkdir()
    out.write_bytes(b"old contents")
    store.get_file("ckpt/model.pt", out)
    assert out.read_bytes() == data
    assert sorted(os.listdir(out.parent)) == ["model.pt"]  # no temporary left behind
    assert store.get_bytes("ckpt/model.pt") == data
    if isinstance(store, S3Storage):  # really went through multipart upload
        head = store.client.head_object(Bucket=BUCKET, Key=f"{store.prefix}/ckpt/model.pt")
        assert head["ETag"].strip('"').endswith("-2"), head["ETag"]
    else:
        assert store.local_path("ckpt/model.pt").read_bytes() == data


def test_list_exists_size_delete(store):
    for key in ["step_1/model.pt", "step_1/optim.pt", "step_10/model.pt", "step_2/model.pt", "latest.json"]:
        store.put_bytes(key, key.encode())
    assert store.list() == ["latest.json", "step_1/model.pt", "step_1/optim.pt", "step_10/model.pt", "step_2/model.pt"]
    assert store.list("step_1/") == ["step_1/model.pt", "step_1/optim.pt"]
    assert store.list("step_1") == ["step_1/model.pt", "step_1/optim.pt", "step_10/model.pt"]
    assert store.list("step_1/m") == ["step_1/model.pt"]
    assert store.list("nothing/") == []
    assert store.exists("latest.json") and not store.exists("step_3/model.pt")
    assert not store.exists("step_1")  # a "directory" is not a key
    assert store.size("step_2/model.pt") == len(b"step_2/model.pt")

    store.delete("latest.json")
    store.delete("latest.json")  # missing is fine
    store.delete("never/was")
    assert not store.exists("latest.json")

    store.delete_prefix("step_1")  # directory semantics: step_10 survives
    assert store.list() == ["step_10/model.pt", "step_2/model.pt"]
    store.delete_prefix("absent/")
    store.delete_prefix("")
    assert store.list() == []


def test_missing_keys_raise_not_found(store, tmp_path):
    for call in (
        lambda: store.get_bytes("no/such.bin"),
        lambda: store.size("no/such.bin"),
        lambda: store.get_file("no/such.bin", tmp_path / "x"),
    ):
        with pytest.raises(NotFound, match="no/such.bin"):
            call()
    assert not (tmp_path / "x").exists()
    assert issubclass(NotFound, StorageError)


@pytest.mark.parametrize("bad", ["/etc/passwd", "../x", "a/../../x", "a//b", "a/./b", "", "a\\b", "..", "a/", "./a"])
def test_keys_that_escape_the_root_are_rejected(store, bad):
    for call in (store.put_bytes, store.get_bytes, store.exists, store.delete):
        with pytest.raises(ValueError, match="invalid storage key"):
            call(bad, b"x") if call == store.put_bytes else call(bad)
    if bad not in ("", "a/"):  # valid prefixes
        with pytest.raises(ValueError):
            store.list(bad)
        with pytest.raises(ValueError):
            store.delete_prefix(bad)


def test_local_writes_are_atomic_and_hide_temporaries(tmp_path):
    store = LocalStorage(tmp_path / "root")
    store.put_bytes("k", b"v1")
    (tmp_path / "root" / ".k.tmp-999-dead").write_bytes(b"torn write of a killed writer")
    assert store.list() == ["k"] and store.get_bytes("k") == b"v1"
    assert store.local_path("a/b") == tmp_path / "root" / "a" / "b"
    assert store.url == (tmp_path / "root").as_uri()


@pytest.mark.parametrize("write", ["put_bytes", "put_stream"])
def test_a_directory_where_a_key_belongs_is_reported_then_moved_aside_by_the_next_write(tmp_path, write):
    store = LocalStorage(tmp_path / "root")
    (tmp_path / "root" / "k").mkdir(parents=True)
    (tmp_path / "root" / "k" / "kept").write_text("someone's files")

    with pytest.raises(NotAFile, match="is a directory"):
        store.get_bytes("k")
    with pytest.raises(NotAFile):
        store.size("k")
    {
        "put_bytes": lambda: store.put_bytes("k", b"v"),
        "put_stream": lambda: store.put_stream("k", lambda f: f.write(b"v")),
    }[write]()

    assert store.get_bytes("k") == b"v"
    (aside,) = [p for p in (tmp_path / "root").iterdir() if p.name.startswith("k.not-a-file-")]
    assert (aside / "kept").read_text() == "someone's files"  # moved, never deleted


# --- URLs, secrets, credentials ----------------------------------------------------------


def test_open_storage_urls(tmp_path):
    assert isinstance(open_storage(str(tmp_path)), LocalStorage)
    local = open_storage(tmp_path.as_uri())
    assert isinstance(local, LocalStorage) and local.root == tmp_path
    s3 = open_storage("s3://my-bucket/runs/r1/", endpoint_url="http://127.0.0.1:1", secret_key="SUPERSECRET")
    assert (s3.bucket, s3.prefix, s3.url) == ("my-bucket", "runs/r1", "s3://my-bucket/runs/r1")
    assert "SUPERSECRET" not in repr(s3) + s3.url
    assert s3.local_path("x") is None
    clone = pickle.loads(pickle.dumps(s3))  # can be handed to worker processes
    assert clone.url == s3.url
    for bad in ("s3://ak:sk@bucket/x", "ftp://host/x", "file://otherhost/x", "s3:///x"):
        with pytest.raises(ValueError) as info:
            open_storage(bad)
        assert "sk@" not in str(info.value)
    with pytest.raises(ValueError):
        open_storage(str(tmp_path), endpoint_url="http://x")


def test_wrong_secret_key_is_a_clear_error(seaweed):
    wrong = "wrong-secret-" + uuid.uuid4().hex
    store = s3_storage(seaweed.endpoint, secret_key=wrong, max_attempts=2)
    for call in (
        lambda: store.put_bytes("k", b"x"),
        lambda: store.get_bytes("k"),
        lambda: store.exists("k"),
        lambda: store.list(),
    ):
        with pytest.raises(StorageError) as info:
            call()
        msg = str(info.value)
        assert not isinstance(info.value, NotFound), msg  # a 403 must never read as "missing"
        assert store.url in msg and "secret key" in msg, msg
        assert wrong not in msg and SECRET_KEY not in msg
    assert wrong not in repr(store)


def _chunks(data: bytes, size: int = MiB):
    """A producer that writes ``data`` in pieces, as ``torch.save`` does."""

    def write(f):
        for i in range(0, len(data), size):
            f.write(memoryview(data)[i : i + size])

    return write


def test_stream_round_trip(store):
    data = os.urandom(12 * MiB + 7)  # > threshold: a multipart upload from a pipe on S3
    store.put_stream("ckpt/model.pt", _chunks(data))
    assert store.get_bytes("ckpt/model.pt") == data
    store.put_stream("small", _chunks(b"tiny"))
    assert store.get_bytes("small") == b"tiny"
    assert store.list() == ["ckpt/model.pt", "small"]  # no temporary left behind


def test_streamed_read_returns_the_object_in_bounded_blocks(store):
    data = os.urandom(12 * MiB + 7)
    store.put_bytes("ckpt/model.pt", data)
    blocks = list(store.iter_bytes("ckpt/model.pt", chunk=MiB))
    assert b"".join(blocks) == data and max(len(b) for b in blocks) <= MiB
    with pytest.raises(NotFound):
        list(store.iter_bytes("ckpt/missing.pt"))


def test_failing_producer_stores_nothing(store):
    """``torch.save`` raising half way through a shard must not leave a truncated object,
    nor (on S3) an unfinished multipart upload."""
    store.put_stream("ckpt/model.pt", _chunks(b"previous"))

    def half_then_fail(f):
        _chunks(os.urandom(11 * MiB))(f)  # two full parts already uploaded on S3
        raise ValueError("cannot pickle this")

    with pytest.raises(ValueError, match="cannot pickle this"):
        store.put_stream("ckpt/model.pt", half_then_fail)
    assert store.get_bytes("ckpt/model.pt") == b"previous"
    for _ in range(10):  # failing before the first byte: the consumer must not see an empty, complete stream
        with pytest.raises(RuntimeError, match="early"):
            store.put_stream("ckpt/other.pt", lambda f: (_ for _ in ()).throw(RuntimeError("early")))
    assert store.list() == ["ckpt/model.pt"]
    if isinstance(store, S3Storage):
        assert store.client.list_multipart_uploads(Bucket=BUCKET, Prefix=store.prefix).get("Uploads", []) == []


# --- faults: the server dies in the middle of a multipart upload --------------------------


def _kill_after_first_part(store: S3Storage, server) -> list[float]:
    """Kill ``server`` (SIGKILL) as soon as the first UploadPart of ``store`` is answered."""
    killed: list[float] = []

    def hook(**_):
        if not killed:
            server.kill()
            killed.append(time.monotonic())

    store.client.meta.events.register("after-call.s3.UploadPart", hook)
    return killed


def test_server_killed_mid_upload_keeps_previous_object(seaweed_factory, tmp_path):
    server = seaweed_factory()
    store = s3_storage(server.endpoint, prefix="run", max_attempts=2, connect_timeout=2, read_timeout=5)
    store.put_bytes("ckpt/model.pt", b"v1")
    _big_file(tmp_path / "v2.bin", 16 * MiB)  # 4 parts of 5 MiB

    killed = _kill_after_first_part(store, server)
    with pytest.raises(StorageError, match="s3://ckpt/run/ckpt/model.pt"):
        store.put_file("ckpt/model.pt", tmp_path / "v2.bin")
    assert killed, "the server was not killed during the upload"

    server.start()  # same data directory and ports
    after = s3_storage(server.endpoint, prefix="run")
    assert after.get_bytes("ckpt/model.pt") == b"v1"
    assert after.list() == ["ckpt/model.pt"]  # no partial object under any name
    # boto3 could not abort the upload on a dead server: its parts survive the restart.
    assert after.abort_incomplete_uploads() == 1
    assert after.client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []) == []
    assert after.get_bytes("ckpt/model.pt") == b"v1"


def test_server_killed_mid_stream_fails_and_ends_the_producer(seaweed_factory):
    """The upload dies while ``torch.save`` is still producing: a storage error, the producer
    is not left blocked on a full pipe, the previous object stays."""
    server = seaweed_factory()
    store = s3_storage(server.endpoint, prefix="run", max_attempts=2, connect_timeout=2, read_timeout=5)
    store.put_bytes("ckpt/model.pt", b"v1")
    killed = _kill_after_first_part(store, server)
    with pytest.raises(StorageError, match="s3://ckpt/run/ckpt/model.pt"):
        store.put_stream("ckpt/model.pt", _chunks(os.urandom(32 * MiB)))
    assert killed
    assert not [t for t in threading.enumerate() if t.name == "pipe-producer"]
    server.start()
    assert s3_storage(server.endpoint, prefix="run").get_bytes("ckpt/model.pt") == b"v1"


def test_endpoint_gone_mid_upload_fails_clearly_and_boundedly(moto_factory, tmp_path):
    server = moto_factory()
    store = s3_storage(server.endpoint, prefix="run", max_attempts=3, connect_timeout=2, read_timeout=5)
    store.put_bytes("ckpt/model.pt", b"v1")
    _big_file(tmp_path / "v2.bin", 16 * MiB)

    killed = _kill_after_first_part(store, server)
    start = time.monotonic()
    with pytest.raises(StorageError) as info:
        store.put_file("ckpt/model.pt", tmp_path / "v2.bin")
    elapsed = time.monotonic() - start
    msg = str(info.value)
    assert killed and not isinstance(info.value, NotFound)
    assert "s3://ckpt/run/ckpt/model.pt" in msg and server.endpoint in msg, msg
    assert "attempts" in msg and "reachable" in msg, msg
    assert SECRET_KEY not in msg
    assert elapsed < 30, f"retries are not bounded: {elapsed:.1f}s"  # generous: no hang

    # Reads against the dead endpoint are errors too, never "not found" / "absent".
    for call in (lambda: store.get_bytes("ckpt/model.pt"), lambda: store.exists("ckpt/model.pt")):
        with pytest.raises(StorageError) as info:
            call()
        assert not isinstance(info.value, NotFound) and server.endpoint in str(info.value)


@pytest.mark.parametrize(
    "error, unreachable",
    [
        ({"Code": "SlowDown"}, True),  # throttled: the same request later
        ({"Code": "InternalError"}, True),
        ({"Code": "ServiceUnavailable"}, True),
        ({"Code": "502"}, True),
        ({"Code": "AccessDenied"}, False),  # refusals: retrying changes nothing
        ({"Code": "NoSuchBucket"}, False),
        ({"Code": "InvalidRequest"}, False),
    ],
)
def test_an_s3_error_says_whether_the_storage_may_answer_later(error, unreachable):
    from botocore.exceptions import ClientError

    err = open_storage(f"s3://{BUCKET}/x", endpoint_url="http://127.0.0.1:9")._error(
        "upload", "k", ClientError({"Error": {**error, "Message": "m"}}, "PutObject")
    )
    assert isinstance(err, StorageError) and isinstance(err, StorageUnreachable) is unreachable


def test_an_endpoint_that_does_not_answer_is_unreachable_storage():
    with pytest.raises(StorageUnreachable, match="check that the S3 endpoint http://127.0.0.1:9 is up"):
        open_storage(
            f"s3://{BUCKET}/x",
            endpoint_url="http://127.0.0.1:9",
            max_attempts=1,
            region="us-east-1",
            access_key=ACCESS_KEY,
            secret_key=SECRET_KEY,
        ).put_bytes("k", b"1")
