"""Glob patterns as regular expressions, so local paths and S3 keys match by the same rules:
``*`` and ``?`` stay within one path segment, ``**`` crosses segments (``a/**/b`` also matches
``a/b``), ``[...]`` is a character class (``[!...]`` negated)."""

from __future__ import annotations

import re

GLOB_CHARS = "*?["


def has_glob(pattern: str) -> bool:
    return any(c in pattern for c in GLOB_CHARS)


def literal_prefix(pattern: str) -> str:
    """The part of ``pattern`` before its first glob character (what a listing can start from)."""
    cut = min((i for i in (pattern.find(c) for c in GLOB_CHARS) if i >= 0), default=len(pattern))
    return pattern[:cut]


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A regular expression matching the whole of a path (or key) that ``pattern`` matches."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and (end := pattern.find("]", i + 2)) > 0:
            body = pattern[i + 1 : end]
            negate = body.startswith("!")
            body = re.sub(r"([\\\]^])", r"\\\1", body[1:] if negate else body)
            out.append(f"[{'^/' if negate else ''}{body}]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z", re.DOTALL)
