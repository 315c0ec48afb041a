"""Bytes → document text under the data spec's rules: binary data (a NUL byte, or more than
``binary_threshold`` of invalid UTF-8) is never trained on; isolated invalid bytes follow
``decode_errors`` (replace / skip / error)."""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass

from pretrain.data.corpus.files import CorpusError
from pretrain.spec.data import DataSpec

SKIP_REASONS = ("binary", "decode", "bad_record", "empty")
_ESCAPED = re.compile("[\udc80-\udcff]")  # invalid bytes as surrogateescape decodes them
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Doc:
    """One document's text."""

    text: str


@dataclass(frozen=True)
class Skip:
    """Something not trained on, to be counted: ``reason`` is one of SKIP_REASONS, ``where``
    names the file (and line, bytes or row)."""

    reason: str
    where: str


def invalid_share(data: bytes, final: bool = True) -> float:
    """Share of ``data``'s bytes that are not valid UTF-8 (``final=False``: a sequence cut at
    the end, as in a file's head, is not counted)."""
    if not data:
        return 0.0
    text = codecs.getincrementaldecoder("utf-8")("surrogateescape").decode(data, final=final)
    return len(_ESCAPED.findall(text)) / len(data)


def looks_binary(data: bytes, threshold: float, final: bool = True) -> bool:
    if b"\0" in data:
        return True
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return invalid_share(data, final) > threshold


def _invalid(data: DataSpec, where: str, detail: str) -> Skip | str:
    """The outcome of invalid text that is not binary, per ``data.decode_errors``."""
    if data.decode_errors == "skip":
        return Skip("decode", where)
    raise CorpusError(
        f"{where}: {detail}; fix the file, or set data.decode_errors: replace (or skip) "
        "to accept (or skip and count) such documents"
    )


def decode(raw: bytes, data: DataSpec, where: str, *, binary_check: bool = True) -> str | Skip:
    """``raw`` as text; a :class:`Skip` when it is binary (with ``binary_check``) or invalid and
    ``decode_errors: skip``; :class:`CorpusError` when invalid and ``decode_errors: error``."""
    if binary_check and b"\0" in raw:
        return Skip("binary", where)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        if binary_check and invalid_share(raw) > data.binary_threshold:
            return Skip("binary", where)
        if data.decode_errors == "replace":
            return raw.decode("utf-8", "replace")
        return _invalid(data, where, f"invalid UTF-8 at byte {err.start} ({raw[err.start : err.start + 4]!r})")


def clean(text: str, data: DataSpec, where: str) -> str | Skip:
    """A decoded JSON string may hold lone surrogates (from '\\ud800' escapes), which are not
    text and which the tokenizer cannot take: treated as invalid bytes."""
    if not _SURROGATE.search(text):
        return text
    if data.decode_errors == "replace":
        return _SURROGATE.sub("\ufffd", text)
    return _invalid(data, where, "a lone surrogate escape (\\ud800-\\udfff) in the text")


def document(text: str | Skip, where: str) -> Doc | Skip:
    """A :class:`Doc`, or ``Skip('empty')`` for text that is only whitespace."""
    if isinstance(text, Skip):
        return text
    return Doc(text) if text and not text.isspace() else Skip("empty", where)
