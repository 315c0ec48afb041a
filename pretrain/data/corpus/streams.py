"""A source file's bytes as a buffered binary stream, local or on S3 (ranged GETs through
:class:`trainer.storage.s3.S3Storage`, pinned to the listed ETag), decompressed for .gz/.zst;
every failure to read becomes a :class:`CorpusError` naming the file and what to do."""

from __future__ import annotations

import gzip
import io
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import BinaryIO

from pretrain.data.corpus.files import CorpusError, SourceFile, bucket_storage
from trainer.storage import StorageError

LOCAL_BUFFER = 1 << 20
S3_BUFFER = 8 << 20  # bytes per ranged GET when reading sequentially


class S3RangeFile(io.RawIOBase):
    """A seekable read-only file over one S3 object: each read is a ranged GET of that exact
    version (If-Match on its ETag), so only the bytes asked for travel. Past ``soft_stop`` (where
    the reader expects to stop: a unit's end) reads shrink to ``TAIL`` bytes, so a read buffer
    does not fetch megabytes beyond it to finish a line."""

    TAIL = 64 << 10

    def __init__(self, storage, key: str, size: int, etag: str | None, soft_stop: int | None = None):
        self.storage, self.key, self.size, self.etag, self.pos = storage, key, size, etag, 0
        self.soft_stop = soft_stop

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
        if self.soft_stop is not None:
            n = min(n, max(self.soft_stop - self.pos, self.TAIL))
        if n <= 0:
            return 0
        data = self.storage.read_range(self.key, self.pos, self.pos + n, self.etag)
        buf[: len(data)] = data
        self.pos += len(data)
        return len(data)


class ZstdReader(io.RawIOBase):
    """Decompresses a zstd stream (one or more frames) and, unlike ``stream_reader``, fails on a
    stream that ends in the middle of a frame (a truncated file) instead of ending quietly."""

    def __init__(self, f: BinaryIO, block: int = 1 << 16):
        import zstandard

        self._new = zstandard.ZstdDecompressor().decompressobj
        self.f, self.block, self.d, self.fed = f, block, self._new(), False
        self.pending, self.at = b"", 0  # decompressed bytes not yet read: pending[at:]

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while self.at >= len(self.pending):
            self.pending, self.at = b"", 0
            data = self.f.read(self.block)
            if not data:
                if self.fed and not self.d.eof:
                    raise EOFError("the zstd data ends in the middle of a frame (the file is truncated)")
                return 0
            while data:
                if self.d.eof:  # the next frame
                    self.d, self.fed = self._new(), False
                self.pending += self.d.decompress(data)
                self.fed = True
                data = self.d.unused_data if self.d.eof else b""
        n = min(len(buf), len(self.pending) - self.at)
        buf[:n] = memoryview(self.pending)[self.at : self.at + n]
        self.at += n
        return n


def _changed(source: SourceFile) -> CorpusError:
    return CorpusError(
        f"{source.describe()} changed while the corpus was being prepared (size or "
        "modification time differ from when it was listed); run again"
    )


def _open_stored(source: SourceFile, s3_options: dict | None, stop: int | None, buffered: bool) -> BinaryIO:
    """The file's bytes as stored (still compressed), seekable; reading is expected to end near
    ``stop``; unbuffered: each read is one ranged GET of what was asked (for Parquet)."""
    if source.is_s3:
        bucket, key = source.bucket_key()
        raw = S3RangeFile(bucket_storage(bucket, s3_options), key, source.size, source.identity or None, stop)
        return io.BufferedReader(raw, S3_BUFFER) if buffered else raw
    st = os.stat(source.uri)
    if f"{st.st_size}:{st.st_mtime_ns}" != source.identity:
        raise _changed(source)
    return open(source.uri, "rb", buffering=LOCAL_BUFFER if buffered else 0)  # noqa: SIM115 - closed by the caller


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
        raise CorpusError(
            f"{source.describe()} no longer exists: restore it (or remove it from data.sources) and run again"
        ) from None
    except (OSError, EOFError, zstandard.ZstdError) as err:
        what = f"a damaged {source.compression} file" if source.compression else "unreadable"
        raise CorpusError(
            f"{source.describe()} is {what} ({type(err).__name__}: {err}); replace or "
            "fix the file, or remove it from data.sources"
        ) from None


@contextmanager
def open_source(
    source: SourceFile, s3_options: dict | None, *, decoded: bool = True, stop: int | None = None, buffered: bool = True
) -> Iterator[BinaryIO]:
    """The file's bytes (decompressed unless ``decoded=False``), closed on exit; read failures
    inside the block are :class:`CorpusError`. ``stop``: the stored byte near which reading
    will end; ``buffered=False``: raw reads (no read-ahead)."""
    with reading(source), ExitStack() as stack:
        stream = stack.enter_context(_open_stored(source, s3_options, None if source.compression else stop, buffered))
        if decoded and source.compression == "gz":
            stream = stack.enter_context(gzip.GzipFile(fileobj=stream, mode="rb"))
        elif decoded and source.compression == "zst":
            stream = stack.enter_context(io.BufferedReader(ZstdReader(stream), LOCAL_BUFFER))
        yield stream


def head(source: SourceFile, s3_options: dict | None, n: int) -> bytes:
    """The first ``n`` (decompressed) bytes of the file."""
    with open_source(source, s3_options, stop=n) as f:
        return f.read(n)


def count_lines_before(source: SourceFile, s3_options: dict | None, offset: int) -> int:
    """How many newlines the stored file has before byte ``offset`` (for line numbers in
    messages about a later unit of an uncompressed file)."""
    count = 0
    with open_source(source, s3_options, decoded=False, stop=offset) as f:
        while offset > 0 and (block := f.read(min(offset, LOCAL_BUFFER))):
            count += block.count(b"\n")
            offset -= len(block)
    return count
