"""How every ``pretrain`` command reports an error a user can act on: one line on stderr and an
exit code (2: wrong input or state to fix; 1: the work itself failed), never a traceback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console

err = Console(stderr=True, soft_wrap=True)  # paths in messages stay whole (copy-paste)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` and return the exit to raise."""
    err.print(f"error: {message}", highlight=False)
    return typer.Exit(code)


@contextmanager
def refused(*errors: type[BaseException], code: int = 2) -> Iterator[None]:
    """Any of ``errors`` raised inside ends the command: ``error: <it>``, exit ``code`` (an
    operating system's error as ``<file>: <what>``, not ``[Errno N] …``)."""
    try:
        yield
    except errors as e:
        raise fail(describe(e), code) from None


def describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror and str(e).startswith("[Errno"):
        where = " → ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
        return f"{where}: {e.strerror}" if where else e.strerror
    return str(e)


def fail_fast_on_mlflow() -> None:
    """For a command a person waits on: an MLflow server that is away is an error after ~10 s
    (2 retries), not after MLflow's default ~4 minutes of silent retries. A user's own
    ``MLFLOW_HTTP_REQUEST_*`` settings win. (Not for ``pretrain run``: training keeps its steps
    and retries with backoff for as long as MLflow is away.)"""
    import os

    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
