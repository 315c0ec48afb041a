"""Credentials a campaign's blocks name, kept in this process's memory and handed out explicitly:
to child processes as their environment (``env=``), to in-process S3 clients as keyword
arguments. Never written to os.environ, the spec, the ledger, job files, MLflow or logs.

A block that names no credentials gives none: boto3 then finds them itself in each process (the
AWS environment, a profile, an instance or IRSA role), which also refreshes temporary keys.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

# environment variable → S3Storage keyword argument
_S3_KWARGS = {"AWS_ACCESS_KEY_ID": "access_key", "AWS_SECRET_ACCESS_KEY": "secret_key",
              "AWS_SESSION_TOKEN": "session_token", "AWS_PROFILE": "profile"}


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

    def merged(self, other: "Credentials") -> "Credentials":
        return Credentials({**self.env, **other.env})

    def child_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for a child process: ``base`` (default: this process's) plus these."""
        return {**(os.environ if base is None else base), **self.env}

    def s3_options(self) -> dict[str, str]:
        """Keyword arguments for an in-process S3 client (``S3Storage``); empty when the block named none."""
        return {kw: self.env[var] for var, kw in _S3_KWARGS.items() if var in self.env}

    def mlflow_token(self) -> str | None:
        return self.env.get("MLFLOW_TRACKING_TOKEN")
