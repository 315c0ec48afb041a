"""A source file's bytes as a buffered binary stream, local or on S3 (ranged GETs through
:class:`trainer.storage.s3.S3Storage`, pinned to the listed ETag), decompressed for .gz/.zst;
every failure to read becomes a :class:`CorpusError` naming the file and what to do."""

from __future__ import annotations

import gzip
import io
import os
from contextlib import ExitStack, contextmanager
from typing import BinaryIO, Iterator

from pretrain.corpus.files import CorpusError, SourceFile
from trainer.storage import StorageError, open_storage

LOCAL_BUFFER = 1 << 20
S3_BUFFER = 8 << 20  # bytes per ranged GET when reading sequentially


class S3RangeFile(io.RawIOBase):
    """A seekable read-only file over one S3 object: each read is a ranged GET of that exact
    version (If-Match on its ETag), so only the bytes asked for travel."""

    def __init__(self, storage, key: str, size: int, etag: str | None):
        self.storage, self.key, self.size, self.etag, self.pos = storage, key, size, etag, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self.size - self.pos)
        if n <= 0:
            return 0
        data = self.storage.read_range(self.key, self.pos, self.pos + n, self.etag)
        buf[:len(data)] = data
        self.pos += len(data)
        return len(data)


def _changed(source: SourceFile) -> CorpusError:
    return CorpusError(f"{source.describe()} changed while the corpus was being prepared (size or "
                       "modification time differ from when it was listed); run again")


def _open_stored(source: SourceFile, s3_options: dict | None) -> BinaryIO:
    """The file's bytes as stored (still compressed), seekable."""
    if source.is_s3:
        bucket, key = source.bucket_key()
        storage = open_storage(f"s3://{bucket}", **(s3_options or {}))
        return io.BufferedReader(S3RangeFile(storage, key, source.size, source.identity or None), S3_BUFFER)
    st = os.stat(source.uri)
    if f"{st.st_size}:{st.st_mtime_ns}" != source.identity:
        raise _changed(source)
    return open(source.uri, "rb", buffering=LOCAL_BUFFER)  # noqa: SIM115 - closed by the caller's stack


@contextmanager
def reading(source: SourceFile) -> Iterator[None]:
    """Turn any failure to read ``source`` inside the block into a :class:`CorpusError`."""
    import zstandard

    try:
        yield
    except CorpusError:
        raise
    except StorageError as err:
        raise CorpusError(f"{source.describe()} cannot be read: {err}") from None
    except FileNotFoundError:
        raise CorpusError(f"{source.describe()} no longer exists: restore it (or remove it from "
                          "data.sources) and run again") from None
    except (OSError, EOFError, zstandard.ZstdError) as err:
        what = f"a damaged {source.compression} file" if source.compression else "unreadable"
        raise CorpusError(f"{source.describe()} is {what} ({type(err).__name__}: {err}); replace or "
                          "fix the file, or remove it from data.sources") from None


@contextmanager
def open_source(source: SourceFile, s3_options: dict | None, *, decoded: bool = True) -> Iterator[BinaryIO]:
    """The file's bytes (decompressed unless ``decoded=False``), closed on exit; read failures
    inside the block are :class:`CorpusError`."""
    with reading(source), ExitStack() as stack:
        stream = stack.enter_context(_open_stored(source, s3_options))
        if decoded and source.compression == "gz":
            stream = stack.enter_context(gzip.GzipFile(fileobj=stream, mode="rb"))
        elif decoded and source.compression == "zst":
            import zstandard

            reader = stack.enter_context(zstandard.ZstdDecompressor().stream_reader(stream))
            stream = stack.enter_context(io.BufferedReader(reader, LOCAL_BUFFER))
        yield stream


def head(source: SourceFile, s3_options: dict | None, n: int) -> bytes:
    """The first ``n`` (decompressed) bytes of the file."""
    with open_source(source, s3_options) as f:
        return f.read(n)


def count_lines_before(source: SourceFile, s3_options: dict | None, offset: int) -> int:
    """How many newlines the stored file has before byte ``offset`` (for line numbers in
    messages about a later unit of an uncompressed file)."""
    count = 0
    with open_source(source, s3_options, decoded=False) as f:
        while offset > 0 and (block := f.read(min(offset, LOCAL_BUFFER))):
            count += block.count(b"\n")
            offset -= len(block)
    return count
