"""Reading one work unit into documents, streamed (one unit's bytes at most in memory): a text
unit is one document (a compressed text file: one per ``unit_bytes``, cut after a newline); a
JSONL line is one document (its ``text_field``); a Parquet row is one document. What is not
trained on comes out as a counted :class:`Skip`; what must stop preparation is a
:class:`CorpusError` naming the file (and line) and what to do."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import BinaryIO

from pretrain.data.corpus.decoding import SKIP_REASONS, Doc, Skip, clean, decode, document, looks_binary
from pretrain.data.corpus.files import CorpusError
from pretrain.data.corpus.streams import count_lines_before, head, open_source
from pretrain.data.corpus.units import WorkUnit
from pretrain.spec.data import DataSpec

__all__ = ["Doc", "SKIP_REASONS", "Skip", "read_unit", "reader_settings"]

HEAD_BYTES = 8192  # a file whose head looks binary is skipped whole
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark at the start of a file is not text


def reader_settings(data: DataSpec) -> dict:
    """The settings that change what :func:`read_unit` yields for the same unit: a cache of
    unit results must key on them too (with :attr:`WorkUnit.key` and the tokenizer)."""
    return {k: getattr(data, k) for k in ("decode_errors", "binary_threshold", "on_bad_record")}


def read_unit(unit: WorkUnit, data: DataSpec, s3_options: dict | None = None) -> Iterator[Doc | Skip]:
    """The documents (and skips) of ``unit``, in file order."""
    src = unit.source
    if src.format == "parquet":
        from pretrain.data.corpus.parquet import read_row_groups

        yield from read_row_groups(unit.source, range(unit.start, unit.stop), data, s3_options)
        return
    if looks_binary(head(src, s3_options, HEAD_BYTES), data.binary_threshold, final=False):
        if unit.start == 0:  # counted once per file, by its first unit
            yield Skip("binary", src.uri)
        return
    with open_source(src, s3_options, stop=unit.stop) as f:
        pos = 0
        if unit.start > 0:  # skip the line that began in the previous unit (if any)
            f.seek(unit.start - 1)
            pos = unit.start - 1 + _skip_line(f)
        if src.format == "jsonl":
            yield from _jsonl(f, pos, unit, data, s3_options)
        else:
            yield from _text(f, pos, unit, data)


def _skip_line(f: BinaryIO, block: int = 1 << 20) -> int:
    """Read past the next newline without holding the line (it may be long); returns bytes read."""
    n = 0
    while part := f.readline(block):
        n += len(part)
        if part.endswith(b"\n"):
            break
    return n


def _text(f: BinaryIO, pos: int, unit: WorkUnit, data: DataSpec) -> Iterator[Doc | Skip]:
    """One document per unit; a compressed file (one unit) is cut every ``unit_bytes`` the same
    way, so it gives the same documents as the same file uncompressed."""
    src = unit.source
    whole = unit.start == 0 and unit.stop >= src.size and not src.compression
    while True:
        end = (pos // unit.chunk_bytes + 1) * unit.chunk_bytes if unit.chunk_bytes else unit.stop
        chunk = f.read(end - pos) if pos < end else b""
        if not chunk:
            if pos == 0:
                yield Skip("empty", src.uri)
            return
        if not chunk.endswith(b"\n"):
            chunk += f.readline()  # the last line belongs to this unit: its first byte is in it
        where = src.uri if whole else f"{src.uri} bytes {pos}-{pos + len(chunk)}"
        pos, chunk = pos + len(chunk), chunk.removeprefix(BOM) if pos == 0 else chunk
        yield document(decode(chunk, data, where), where)
        if not unit.chunk_bytes:
            return


def _jsonl(f: BinaryIO, pos: int, unit: WorkUnit, data: DataSpec, s3_options: dict | None) -> Iterator[Doc | Skip]:
    src, field, first = unit.source, unit.source.text_field, pos
    base: list[int] = []  # line number of the unit's first line, counted only when a message needs it
    lines = 0

    def where(offset: int) -> str:
        if first == 0 or base:
            return f"{src.uri} line {(base[0] if base else 1) + lines - 1}"
        return f"{src.uri} byte {offset}"  # counting lines before a later unit costs a read of them

    def located(offset: int) -> str:
        """The file and line number, for an error (counts the lines before a later unit)."""
        if not base and first > 0:
            base.append(count_lines_before(src, s3_options, first) + 1)
        return f"{src.describe()}: {where(offset).removeprefix(src.uri + ' ')}"

    def bad(problem: str, offset: int) -> Skip:
        if data.on_bad_record == "skip":
            return Skip("bad_record", where(offset))
        raise CorpusError(
            f"{located(offset)}: {problem}; fix the record, or set data.on_bad_record: skip "
            "to skip (and count) such records"
        )

    while src.compression or pos < unit.stop:
        raw = f.readline()
        if not raw:
            return
        offset, pos, lines = pos, pos + len(raw), lines + 1
        if offset == 0:
            raw = raw.removeprefix(BOM)
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            if data.decode_errors == "error":
                raise CorpusError(
                    f"{located(offset)}: invalid UTF-8 at byte {err.start + 1} of the line; fix the "
                    "file, or set data.decode_errors: replace (or skip) to accept (or skip and count) "
                    "such records"
                ) from None
            if data.decode_errors == "skip":
                yield Skip("decode", where(offset))
                continue
            line = raw.decode("utf-8", "replace")
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as err:
            yield bad(f"not JSON ({getattr(err, 'msg', err)}, column {getattr(err, 'colno', '?')})", offset)
            continue
        if not isinstance(record, dict):
            yield bad(f"a JSON {type(record).__name__}, not an object with a {field!r} field", offset)
            continue
        text = record.get(field)
        if not isinstance(text, str):
            fields = ", ".join(map(repr, list(record)[:8])) or "none"
            problem = (
                f"no field {field!r} (its fields: {fields}); set text_field in data.sources"
                if field not in record
                else f"field {field!r} is {type(text).__name__}, not a string"
            )
            yield bad(problem, offset)
            continue
        if "\\u" in line:  # JSON escapes may encode lone surrogates
            text = clean(text, data, located(offset) if data.decode_errors == "error" else where(offset))
        yield Doc(text) if isinstance(text, str) and text and not text.isspace() else document(text, where(offset))
