"""How the suite is spread over pytest-xdist's processes (hooks that tests/conftest.py imports):
the longest files first, and files that share a costly session fixture in one process."""

from __future__ import annotations

# The longest test files first (measured: each runs one or more whole campaigns): the suite runs
# on processes that take whole files (`--dist loadfile`), and a long file started last would run
# alone at the end. xdist would reorder the files by their number of tests (many short unit tests
# first): `--no-loadscope-reorder` in pyproject.toml keeps this order. Order within a file is kept.
LONGEST_FIRST = (
    "test_kube_campaign.py",
    "test_interrupt.py",
    "test_resume.py",
    "test_prefect_server.py",
    "test_s3_campaign.py",
    "test_elastic.py",
    "test_elastic_agent.py",
    "test_gate.py",
    "test_kube_cluster.py",
    "test_kube_cluster_start_failures.py",
    "test_fast_recovery.py",
    "test_fast_recovery_protocol.py",
    "test_data_ux.py",
    "test_chaos.py",
    "test_tracking.py",
    "test_fsdp.py",
    "test_compare.py",
    "test_saver.py",
    "test_storage.py",
    "test_export.py",
    "test_pause.py",
    "test_campaign.py",
    "test_anomaly.py",
    "test_release_before.py",
    "test_spec.py",
    "test_stages.py",
    "test_blocks.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# Files that start the same costly session fixture (a real `prefect server start`, ~10 CPU-s)
# run in one worker process, as one unit of `--dist loadfile`, so it starts once, not per process.
SHARED_FIXTURE_FILES = {"test_prefect_server.py": "prefect-server", "test_blocks.py": "prefect-server"}


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadFileScheduling

    class LoadFileSharingFixtures(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SHARED_FIXTURE_FILES.get(path.rsplit("/", 1)[-1], path)

    return LoadFileSharingFixtures(config, log) if config.getoption("dist") == "loadfile" else None
