"""Parquet sources: planned by the row groups in the file's footer, read one row group (of the
text column only) at a time with pyarrow, local or on S3 (ranged GETs)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pretrain.data.corpus.decoding import Doc, Skip, decode, document
from pretrain.data.corpus.files import CorpusError, SourceFile
from pretrain.data.corpus.streams import open_source
from pretrain.spec.data import DataSpec

BATCH_ROWS = 1024  # rows turned into Python strings at a time


@contextmanager
def _parquet_file(source: SourceFile, s3_options: dict | None):
    """The open ``pyarrow.parquet.ParquetFile``; a damaged file or a missing text column is a
    :class:`CorpusError` naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open_source(source, s3_options, decoded=False, buffered=False) as f:
        try:
            pf = pq.ParquetFile(f)
        except (pa.ArrowException, ValueError) as err:
            raise CorpusError(
                f"{source.describe()} is not a readable Parquet file ({err}); replace or fix it, "
                "or remove it from data.sources"
            ) from None
        names = pf.schema_arrow.names
        if source.text_field not in names:
            shown = ", ".join(map(repr, names[:12]))
            raise CorpusError(
                f"{source.describe()} has no column {source.text_field!r} (its columns: {shown}); "
                "set text_field in data.sources to the column holding the text"
            )
        kind = pf.schema_arrow.field(source.text_field).type
        if not (
            pa.types.is_string(kind)
            or pa.types.is_large_string(kind)
            or pa.types.is_binary(kind)
            or pa.types.is_large_binary(kind)
        ):
            raise CorpusError(
                f"{source.describe()}: column {source.text_field!r} holds {kind}, not text; "
                "set text_field in data.sources to the column holding the text"
            )
        yield pf


def row_group_sizes(source: SourceFile, s3_options: dict | None = None) -> list[int]:
    """Uncompressed bytes of each row group (read from the footer only)."""
    with _parquet_file(source, s3_options) as pf:
        return [pf.metadata.row_group(i).total_byte_size for i in range(pf.metadata.num_row_groups)]


def read_row_groups(
    src: SourceFile, groups: range, data: DataSpec, s3_options: dict | None = None
) -> Iterator[Doc | Skip]:
    """One document per row of the row groups ``groups`` of ``src``: a null is a bad record,
    bytes (a binary column) are decoded under the data spec's rules."""
    import pyarrow as pa

    with _parquet_file(src, s3_options) as pf:
        for group in groups:
            row = 0
            try:
                for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], columns=[src.text_field]):
                    for value in batch.column(0).to_pylist():
                        yield _row(value, src, data, f"row group {group} row {row}")
                        row += 1
            except CorpusError:
                raise
            except (pa.ArrowException, ValueError) as err:
                raise CorpusError(
                    f"{src.describe()}: row group {group} cannot be read ({err}); replace or fix "
                    "the file, or remove it from data.sources"
                ) from None


def _row(value, src: SourceFile, data: DataSpec, at: str) -> Doc | Skip:
    if isinstance(value, str) and value and not value.isspace():
        return Doc(value)
    where = f"{src.uri} {at}"
    if value is None:
        if data.on_bad_record == "error":
            raise CorpusError(
                f"{src.describe()}: {at}: column {src.text_field!r} is null; fix the row, or set "
                "data.on_bad_record: skip to skip (and count) such records"
            )
        return Skip("bad_record", where)
    return document(value if isinstance(value, str) else decode(value, data, where), where)
