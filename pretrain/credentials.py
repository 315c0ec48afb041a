"""Credentials a campaign's blocks name, kept in this process's memory and handed out explicitly:
to child processes as their environment (``env=``), to in-process S3 clients as keyword
arguments. Never written to os.environ, the spec, the ledger, job files, MLflow or logs.

A block that names no credentials gives none: boto3 then finds them itself in each process (the
AWS environment, a profile, an instance or IRSA role), which also refreshes temporary keys.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import MappingProxyType

# environment variable → S3Storage keyword argument
_S3_KWARGS = {
    "AWS_ACCESS_KEY_ID": "access_key",
    "AWS_SECRET_ACCESS_KEY": "secret_key",
    "AWS_SESSION_TOKEN": "session_token",
    "AWS_PROFILE": "profile",
}


@dataclass(frozen=True, repr=False)
class Credentials:
    """Environment variables that authenticate (``AWS_*``, ``MLFLOW_TRACKING_*``), by name."""

    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", MappingProxyType({k: v for k, v in dict(self.env).items() if v}))

    def __repr__(self) -> str:  # names only: a repr ends up in logs and tracebacks
        return f"Credentials({sorted(self.env)})"

    def __bool__(self) -> bool:
        return bool(self.env)

    def child_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for a child process: ``base`` (default: this process's) plus these."""
        return {**(os.environ if base is None else base), **self.env}

    def s3_options(self) -> dict[str, str]:
        """Keyword arguments for an in-process S3 client (``S3Storage``); empty when the block named none."""
        return {kw: self.env[var] for var, kw in _S3_KWARGS.items() if var in self.env}

    def mlflow_token(self) -> str | None:
        return self.env.get("MLFLOW_TRACKING_TOKEN")


# ---- MLflow: the token goes to this context's requests, not to os.environ -------------------
_MLFLOW_TOKEN: ContextVar[str | None] = ContextVar("pretrain_mlflow_token", default=None)
_REGISTERING = threading.Lock()


class _TokenHeader:
    """MLflow request header provider: ``Authorization: Bearer <token>`` for requests made inside
    :func:`mlflow_auth` (MLflow's own MLFLOW_TRACKING_TOKEN, when set, takes precedence)."""

    def in_context(self) -> bool:
        return _MLFLOW_TOKEN.get() is not None

    def request_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {_MLFLOW_TOKEN.get()}"}


def _register_token_header() -> None:
    from mlflow.tracking.request_header import registry

    providers = registry._request_header_provider_registry  # MLflow's registry of header providers
    with _REGISTERING:
        if not any(isinstance(p, _TokenHeader) for p in providers):
            providers.register(_TokenHeader)  # stateless: the token lives in the context variable


@contextmanager
def mlflow_auth(credentials: Credentials) -> Iterator[None]:
    """MLflow clients used inside this block (and in threads and tasks started from it, which copy
    the context) authenticate with the credentials' MLflow token; nothing changes outside it."""
    token = credentials.mlflow_token()
    if token is None:
        yield
        return
    _register_token_header()
    reset = _MLFLOW_TOKEN.set(token)
    try:
        yield
    finally:
        _MLFLOW_TOKEN.reset(reset)
