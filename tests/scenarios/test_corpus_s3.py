"""pretrain.data.corpus on a real S3 server (SeaweedFS): each source kind read from S3 gives the same
documents as from the local disk, globs and prefixes list objects, and S3 failures (missing
bucket, bad credentials, an object changed while preparing) are clear errors."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from pretrain.data.corpus import CorpusError, expand_sources, plan_units, read_unit
from support import s3_servers
from support.corpus_files import compress, read_all, skips, spec, texts, write_jsonl, write_parquet
from support.s3_servers import ACCESS_KEY, BUCKET, SECRET_KEY, s3_client

seaweed = s3_servers.seaweed


@pytest.fixture
def s3(seaweed):
    """(client, s3 URL of a fresh prefix, s3_options as checkpoints build them)."""
    prefix = f"corpus-{uuid.uuid4().hex[:10]}"
    options = {
        "endpoint_url": seaweed.endpoint,
        "region": "us-east-1",
        "access_key": ACCESS_KEY,
        "secret_key": SECRET_KEY,
    }
    return s3_client(seaweed.endpoint), f"s3://{BUCKET}/{prefix}", options


def upload(client, url: str, path: Path) -> str:
    key = f"{url.removeprefix(f's3://{BUCKET}/')}/{path.name}"
    client.put_object(Bucket=BUCKET, Key=key, Body=path.read_bytes())
    return f"s3://{BUCKET}/{key}"


def test_each_source_kind_reads_the_same_from_s3_as_from_disk(s3, tmp_path):
    client, url, options = s3
    records = [f"document {i}: " + "é" * (i % 7) + " words" * (i % 11) for i in range(300)]
    plain = write_jsonl(tmp_path / "a.jsonl", records)
    text = tmp_path / "b.txt"
    text.write_text("".join(f"line {i}\n" for i in range(3000)))
    files = [
        plain,
        compress(plain, "gz"),
        compress(plain, "zst"),
        text,
        write_parquet(tmp_path / "c.parquet", records, row_group_size=40),
    ]
    for path in files:
        upload(client, url, path)
        local, remote = spec([str(path)]), spec([f"{url}/{path.name}"])
        for unit_bytes in (4096, 10**6):  # several ranged units, and one
            expected = read_all(local, unit_bytes)
            assert read_all(remote, unit_bytes, options) == expected, (path.name, unit_bytes)
        assert texts(expected)


def test_s3_globs_and_prefixes_list_objects_in_order_with_their_etag(s3, tmp_path):
    client, url, options = s3
    for name in ("b.jsonl", "a.jsonl", "sub/c.jsonl", "sub/d.txt", "e.jsonl.gz"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(tmp_path / name, [name])
        key = f"{url.removeprefix(f's3://{BUCKET}/')}/{name}"
        client.put_object(Bucket=BUCKET, Key=key, Body=(tmp_path / name).read_bytes())
    client.put_object(Bucket=BUCKET, Key=f"{url.removeprefix(f's3://{BUCKET}/')}/sub/", Body=b"")  # a "directory"

    def names(pattern):
        return [f.uri.removeprefix(url + "/") for f in expand_sources(spec([pattern]), options)["all"]]

    assert names(f"{url}/**.jsonl") == ["a.jsonl", "b.jsonl", "sub/c.jsonl"]
    assert names(f"{url}/*.jsonl") == ["a.jsonl", "b.jsonl"]
    assert names(f"{url}/sub") == ["sub/c.jsonl", "sub/d.txt"]  # a prefix: every object under it
    assert names(f"{url}/**") == ["a.jsonl", "b.jsonl", "e.jsonl.gz", "sub/c.jsonl", "sub/d.txt"]
    assert names(f"{url}/a.jsonl") == ["a.jsonl"]
    gz = expand_sources(spec([f"{url}/e.jsonl.gz"]), options)["all"][0]
    head = client.head_object(Bucket=BUCKET, Key=gz.bucket_key()[1])
    assert (gz.format, gz.compression, gz.size, gz.identity) == (
        "jsonl",
        "gz",
        head["ContentLength"],
        head["ETag"].strip('"'),
    )


@pytest.mark.parametrize(
    "case, message",
    [
        ("no match", r"data.sources\[0\] \(.*\) matched no files: fix the path or pattern"),
        ("no bucket", r"data.sources\[0\] .* cannot be listed: .*NoSuchBucket.*create bucket"),
        ("bad credentials", r"data.sources\[0\] .* cannot be listed: .*check the access key, secret key"),
    ],
)
def test_s3_listing_failures_name_the_entry_and_what_to_do(s3, case, message):
    _, url, options = s3
    source = {
        "no match": f"{url}/nothing/**.jsonl",
        "no bucket": f"s3://no-such-bucket-{uuid.uuid4().hex[:6]}/x.jsonl",
        "bad credentials": f"{url}/x.jsonl",
    }[case]
    if case == "bad credentials":
        options = {**options, "secret_key": "wrong-secret"}
    with pytest.raises(CorpusError, match=message) as err:
        expand_sources(spec([source]), options)
    assert SECRET_KEY not in str(err.value) and "wrong-secret" not in str(err.value)


def test_an_object_replaced_after_listing_is_an_error_not_a_mix(s3, tmp_path):
    client, url, options = s3
    uri = upload(client, url, write_jsonl(tmp_path / "a.jsonl", [f"doc {i}" for i in range(500)]))
    data = spec([uri])
    units = plan_units(expand_sources(data, options)["all"][0], 4096, options)
    assert len(units) > 1
    upload(client, url, write_jsonl(tmp_path / "a.jsonl", [f"new {i}" for i in range(500)]))
    with pytest.raises(CorpusError, match=f"{uri} .*changed since it was listed.*run again"):
        list(read_unit(units[1], data, options))


def test_a_bad_line_in_a_later_s3_unit_is_named_by_line_number(s3, tmp_path):
    client, url, options = s3
    path = tmp_path / "a.jsonl"
    path.write_text("".join(f'{{"text": "doc {i}"}}\n' for i in range(400)) + "oops\n")
    uri = upload(client, url, path)
    with pytest.raises(CorpusError, match=f"{uri} .*: line 401: not JSON"):
        read_all(spec([uri]), 4096, options)
    assert skips(read_all(spec([uri], on_bad_record="skip"), 4096, options))[0][0] == "bad_record"
