"""Which MLflow tracking store a campaign uses, and where its artifacts go.

Campaigns share one store by default, as MLflow's own convention has it (``mlflow.db`` in the
directory they are run from, or the server ``MLFLOW_TRACKING_URI`` names), so MLflow's compare
view works across campaigns with no configuration. A campaign records the store it was created
with in its ledger and keeps using it when resumed from another directory (see
:func:`recorded_store`); a workdir that already holds its own ``mlflow.db`` (campaigns of
earlier releases) keeps using that one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pretrain.redact import MASK

STORE_FILE = "mlflow.db"  # MLflow's default sqlite store name (`mlflow ui` opens it in the directory it runs in)
SHARED_ARTIFACTS = "mlartifacts"  # beside a shared sqlite store: the artifacts of all its campaigns
TRACKING_ENV = "MLFLOW_TRACKING_URI"
# MLflow 3's UI opens an experiment of this kind in its model-training view (charts), not the GenAI one
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


def sqlite_uri(path: Path) -> str:
    return f"sqlite:///{Path(path).resolve()}"


def default_tracking_uri(workdir: Path, environ: Mapping[str, str] | None = None, cwd: Path | None = None) -> str:
    """The store of a campaign whose spec names none: the workdir's own ``mlflow.db`` if it has one
    (a campaign of an earlier release), else ``MLFLOW_TRACKING_URI``, else ``mlflow.db`` in the
    current directory (``cwd``), shared by the campaigns run from there."""
    own = Path(workdir) / STORE_FILE
    return sqlite_uri(own) if own.exists() else shared_tracking_uri(environ, cwd)


def shared_tracking_uri(environ: Mapping[str, str] | None = None, cwd: Path | None = None) -> str:
    """The store campaigns share: ``MLFLOW_TRACKING_URI``, else ``mlflow.db`` in ``cwd`` (MLflow's convention)."""
    env = (os.environ if environ is None else environ).get(TRACKING_ENV, "").strip()
    return env or sqlite_uri(Path(cwd or Path.cwd()) / STORE_FILE)


def recorded_store(recorded: str | None) -> str | None:
    """The store a campaign's ledger records, if it can be used as it is (a URI recorded with its
    credentials masked cannot: the one of the environment is used then)."""
    return recorded if recorded and MASK not in recorded else None


def sqlite_path(uri: str) -> Path | None:
    """The file of a ``sqlite:///`` store; None for any other kind."""
    prefix = "sqlite:///"
    return Path(uri[len(prefix) :]) if uri.startswith(prefix) and len(uri) > len(prefix) else None


def artifact_root(tracking_uri: str, workdir_artifacts: Path) -> Path:
    """Where a new experiment of ``tracking_uri`` keeps its runs' artifacts: beside a shared sqlite
    store (``mlartifacts``, MLflow's own name for it), so that every campaign of the experiment
    finds them; the campaign's workdir for its own store and for a server (unchanged)."""
    db = sqlite_path(tracking_uri)
    if db is None or db.resolve() == (Path(workdir_artifacts).parent / STORE_FILE).resolve():
        return Path(workdir_artifacts)
    return db.parent / SHARED_ARTIFACTS
