"""Data sets on S3 (SeaweedFS) and the upload that puts a data set there: staged files go up as
they are written, the manifest only after every other file."""

from __future__ import annotations

import pytest

from pretrain.data.prepare.errors import DataPrepError
from pretrain.data.prepare.pipeline import prepare
from support import s3_servers
from support.corpora import QUIET, data_set_bytes, docs, jsonl_corpus, spec, wide_tokenizer, write_jsonl
from support.s3_servers import ACCESS_KEY, BUCKET, SECRET_KEY
from trainer.data.manifest import MANIFEST
from trainer.storage import LocalStorage, StorageError, open_storage

seaweed = s3_servers.seaweed  # the session's SeaweedFS (a fixture)


def test_an_s3_root_gets_the_same_data_set_uploaded_manifest_last_and_reuses_it(seaweed, tmp_path):
    """Sources, tokenizer and data set all on SeaweedFS; the bytes equal a local run's."""
    options = {
        "endpoint_url": seaweed.endpoint,
        "region": "us-east-1",
        "access_key": ACCESS_KEY,
        "secret_key": SECRET_KEY,
    }
    bucket = open_storage(f"s3://{BUCKET}/dataset-test", **options)
    for k, path in enumerate(jsonl_corpus(tmp_path / "corpus", files=2, per_file=30)):
        bucket.put_file(f"corpus/part{k}.jsonl", path)
    bucket.put_file("tok/tokenizer.json", wide_tokenizer(tmp_path / "t.json", 1000))
    data = spec(
        [f"s3://{BUCKET}/dataset-test/corpus/*.jsonl"],
        workers=2,
        tokenizer={"path": f"s3://{BUCKET}/dataset-test/tok/tokenizer.json"},
    )
    root = f"s3://{BUCKET}/dataset-test/datasets"

    m = prepare(data, root, work=tmp_path / "work", s3_options=options, **QUIET)
    assert m["location"] == f"{root}/{m['fingerprint']}" and not m["reused"]
    remote = open_storage(m["location"], **options)
    names = remote.list()
    assert MANIFEST in names and len(names) == 2 + sum(len(v) for v in m["splits"].values())
    assert not (tmp_path / "work" / "staging" / m["fingerprint"]).exists()  # the local staging copy is gone
    local = prepare(data, tmp_path / "local", work=tmp_path / "work", s3_options=options, **QUIET)
    assert {n: remote.get_bytes(n) for n in names} == data_set_bytes(local["location"])

    again = prepare(data, root, work=tmp_path / "fresh-work", s3_options=options, **QUIET)
    assert again["reused"] is True and again["fingerprint"] == m["fingerprint"]
    remote.delete(m["splits"]["val"][0]["file"])  # an object lost from the bucket
    repaired = prepare(data, root, work=tmp_path / "fresh-work", s3_options=options, **QUIET)
    assert repaired["reused"] is False and remote.list() == names


@pytest.mark.parametrize(
    "root, secret, message",
    [
        (
            "s3://no-such-bucket/sets",
            SECRET_KEY,
            r"cannot read data sets under s3://no-such-bucket/sets/.*create bucket",
        ),
        (
            f"s3://{BUCKET}/sets",
            "wrong-secret",
            rf"cannot read data sets under s3://{BUCKET}/sets/.*check the access key",
        ),
    ],
    ids=["missing bucket", "bad credentials"],
)
def test_an_s3_root_that_cannot_be_used_is_a_clear_error(seaweed, tmp_path, root, secret, message):
    options = {
        "endpoint_url": seaweed.endpoint,
        "region": "us-east-1",
        "access_key": ACCESS_KEY,
        "secret_key": secret,
        "max_attempts": 1,
    }
    write_jsonl(tmp_path / "c.jsonl", docs(10))
    with pytest.raises(DataPrepError, match=message) as raised:
        prepare(spec([str(tmp_path / "c.jsonl")]), root, work=tmp_path / "w", s3_options=options, **QUIET)
    assert "wrong-secret" not in str(raised.value)


class RecordingStorage(LocalStorage):
    """A real local storage that records what is put, and can refuse one key (an S3 failure)."""

    def __init__(self, root, refuse: str | None = None):
        super().__init__(root)
        self.put, self.refuse = [], refuse

    def put_file(self, key, path):
        if key == self.refuse:
            raise StorageError(f"S3 upload of {key} failed (503: slow down); check the S3 server and retry")
        super().put_file(key, path)
        self.put.append(key)


@pytest.mark.parametrize("refuse", [None, "shard_00007.bin"])
def test_staged_files_upload_as_written_and_the_manifest_only_after_all_of_them(tmp_path, refuse):
    from pretrain.data.prepare.upload import Uploader

    target = RecordingStorage(tmp_path / "remote", refuse=refuse)
    staged = tmp_path / "staging"
    staged.mkdir()
    uploader = Uploader(target, "s3://bucket/sets/fp")
    names = [f"shard_{i:05d}.bin" for i in range(40)]
    try:
        for name in names:
            (staged / name).write_bytes(name.encode() * 1000)
            uploader(staged / name)
        (staged / MANIFEST).write_text("{}")
        uploader.finish(staged / MANIFEST)
    except DataPrepError as err:
        assert refuse and f"uploading the data set to s3://bucket/sets/fp failed: S3 upload of {refuse}" in str(err)
        assert MANIFEST not in target.put  # a data set without all its shards is never committed
        return
    finally:
        uploader.close()
    assert not refuse
    assert sorted(target.put[:-1]) == names and target.put[-1] == MANIFEST
    assert list(staged.iterdir()) == []  # each local copy went once stored
    assert all((tmp_path / "remote" / n).read_bytes() == n.encode() * 1000 for n in names)
