"""Shared fixtures: a Prefect test harness for the session, a prepared data set, small specs."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# tests call some Prefect tasks directly, outside a flow (find_resume_point, the stage evaluation):
# their logs stay local, which is all a test wants; Prefect warned once per such call
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
# the `pretrain run` processes of the CLI tests start their own Prefect API server: its 20 s
# default start-up timeout ran out with the machine loaded ×8 (the campaign then fails at once)
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

from pretrain.data.prepare.pipeline import prepare  # noqa: E402
from pretrain.spec.campaign import CampaignSpec  # noqa: E402
from support.campaigns import (
    DATA,
    HARNESS_DATABASE,
    TRACKING_STORE,
    _migrate_prefect_database,
    _tracking_template,
    made_once,
    save_checkpoint,
    seed_data,
    small_spec,
)  # noqa: E402,F401
from support.prefect_server import on_prefect_server, prefect_server  # noqa: E402,F401 - a real server, on request
from support.scheduling import pytest_collection_modifyitems, pytest_xdist_make_scheduler  # noqa: E402,F401 - hooks


def pytest_configure(config):
    # A shell without job control starts background commands (`pytest … &` in a script) with SIGINT
    # ignored, and an ignored signal stays ignored in every child: the Ctrl-C tests would then see
    # nothing arrive. Python's own handler here gives the children the default again.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def migrated_tracking_store(tmp_path_factory) -> Path:
    """An empty MLflow sqlite store with its tables made, once for the whole session: MLflow
    creates a new store's tables by running its migrations (3–6 s here), which every test that
    tracks, and every worker process of the suite, would otherwise pay."""
    from mlflow.tracking import MlflowClient

    return made_once(
        tmp_path_factory, TRACKING_STORE, lambda path: MlflowClient(f"sqlite:///{path}").search_experiments()
    )


@pytest.fixture(autouse=True)
def own_tracking_store(tmp_path_factory, monkeypatch, migrated_tracking_store) -> str:
    """Each test's campaigns share a tracking store of their own (``MLFLOW_TRACKING_URI``, which a
    campaign without ``tracking.uri`` and without a store in its workdir uses), never one in the
    directory pytest runs in; child processes inherit it. It starts as a copy of the session's
    empty, migrated store and lies outside the test's ``tmp_path`` (tests list what a command
    wrote there). Its URI is the fixture's value, for tests that talk to MLflow themselves."""
    store = tmp_path_factory.mktemp("own-tracking") / TRACKING_STORE
    shutil.copyfile(migrated_tracking_store, store)
    uri = f"sqlite:///{store}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


@pytest.fixture(scope="session")
def migrated_prefect_database(tmp_path_factory) -> Path:
    """An empty Prefect server database with its tables made, once for the whole session: a
    server migrates a new database on start (~5 CPU-s), which every xdist process's harness
    would otherwise pay. Treat it as read-only; copy it."""
    return made_once(tmp_path_factory, "prefect.db", _migrate_prefect_database)


@pytest.fixture(scope="session")
def prefect_harness(zygote, migrated_prefect_database):
    import tempfile

    import prefect.testing.utilities as harness
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    def database_dir() -> str:  # the harness's own temporary directory, its database already migrated
        path = tempfile.mkdtemp()
        shutil.copyfile(migrated_prefect_database, Path(path) / HARNESS_DATABASE)
        return path

    # No flow-run heartbeats in-process: their thread sleeps in 1 s ticks, so every (sub)flow
    # run's exit waited up to 1 s for it (≈ 9 per campaign). Nothing here tests them; the
    # worker tests on a real server run flows in their own processes with the defaults. The
    # server's start-up took over 60 s with the machine loaded ×8.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(harness, "mkdtemp", database_dir)  # where the harness puts its HARNESS_DATABASE
        with (
            temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}),
            harness.prefect_test_harness(server_startup_timeout=180),
        ):
            patch.undo()
            yield


@pytest.fixture(scope="session")
def zygote():
    """A fork server with torch imported, as a campaign run has (``trainer.zygote.client``), for tests
    that start node agents themselves, and the context's zygote for the session: the campaigns a
    test runs in this process fork from it instead of starting their own (2.6 CPU-s each)."""
    from trainer.zygote.client import zygote_running

    with zygote_running() as server:
        yield server


@pytest.fixture(scope="session")
def prepared_data(tmp_path_factory, migrated_tracking_store) -> Path:
    """One data set for the session (its directory ``<root>/<fingerprint>``); campaigns copy it
    (its fingerprint matches their spec). Beside the root, the empty migrated MLflow store that
    :func:`seed_data` copies into a workdir."""
    root = tmp_path_factory.mktemp("prepared") / "data"
    location = Path(prepare(CampaignSpec(data=DATA).data, root, work=root / ".work", log=lambda *_: None)["location"])
    shutil.copyfile(migrated_tracking_store, _tracking_template(location))
    return location


@pytest.fixture(scope="session")
def trained_checkpoint(prepared_data, tmp_path_factory):
    """(spec, checkpoint ref) of a 2-step checkpoint of a small spec; treat it as read-only."""
    spec = small_spec(tmp_path_factory.mktemp("trained"))
    seed_data(spec, prepared_data)
    return spec, save_checkpoint(spec)
