"""Redact anything credential-shaped before it is written where people and tools read it: MLflow
params and tags, Prefect artifacts, the ledger, ``pretrain status`` and log lines.

The spec already refuses credentials in URIs (:mod:`pretrain.spec.uris`); this is the
second line of defence for values that reach a writer some other way (a block, an error
message, a path).
Redaction keeps the shape of the text (scheme, host, parameter names), so what remains still
says where something is, only not with which secret.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from urllib.parse import urlsplit

MASK = "***"

# key names whose value is a secret, alone or as the end of a longer name (MLFLOW_TRACKING_TOKEN)
_SECRET_NAME = (
    r"[A-Za-z0-9_.-]*?(?:secret(?:_access)?(?:_key)?|password|passwd|pwd|token|api[_-]?key"
    r"|access[_-]?key(?:_id)?|credentials?|authorization)"
)
_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # scheme://user:password@host → scheme://***@host
    (re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@'\"]+@"), rf"\g<scheme>{MASK}@"),
    # Bearer / Basic authorization values
    (re.compile(r"(?i)\b(?P<kind>bearer|basic)\s+[A-Za-z0-9._~+/=-]{6,}"), rf"\g<kind> {MASK}"),
    # name=value, name: value, "name": "value", ?name=value&… for secret-looking names
    (
        re.compile(
            rf"(?i)(?P<key>\b{_SECRET_NAME})(?P<sep>['\"]?\s*[=:]\s*['\"]?)(?!{re.escape(MASK)}|bearer\s|basic\s)[^\s'\"&,;}}]+"
        ),
        rf"\g<key>\g<sep>{MASK}",
    ),
    # AWS access key ids (long-term AKIA…, temporary ASIA…)
    (re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b"), MASK),
)
_SECRET_KEY = re.compile(rf"(?i)(?:^|[._-]){_SECRET_NAME}$")


def redact(text: str) -> str:
    """``text`` with every credential-shaped part replaced by ``***``."""
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def redact_value(key: str, value: object) -> str:
    """A value to store under ``key`` (a param or tag name): all of it masked when the key names
    a secret (``...token``, ``...password``), else :func:`redact` of its text."""
    text = str(value)
    return MASK if text and _SECRET_KEY.search(str(key)) else redact(text)


def redact_mapping(values: Mapping[str, object]) -> dict[str, str]:
    """Every value of a flat mapping (params, tags) through :func:`redact_value`."""
    return {k: redact_value(k, v) for k, v in values.items()}


def redact_tree(obj):
    """A JSON-like structure (status, ledger records, table rows) with every string redacted."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, Mapping):
        return {k: redact_value(k, v) if isinstance(v, str) else redact_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_tree(v) for v in obj]
    return obj


def url_credentials(url: str) -> str | None:
    """What in ``url`` is a credential (``'user:password@'``, ``'token=' query parameter``), or None."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if "@" in parts.netloc:
        return "'user:password@' before the host"
    return "a secret query parameter" if redact(parts.query) != parts.query else None
