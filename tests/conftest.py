"""Shared fixtures: a Prefect test harness for the session, a prepared data set, small specs."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import psutil
import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from pretrain.dataprep import prepare  # noqa: E402
from pretrain.layout import CampaignLayout  # noqa: E402
from pretrain.spec import CampaignSpec, parse_spec  # noqa: E402
from prefect_server import on_prefect_server, prefect_server  # noqa: E402,F401 - a real server, on request

DATA = {"sources": ["{stdlib}/json/*.py"], "max_bytes": 200_000, "tokenizer": {"vocab_size": 512}, "val_fraction": 0.2}


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=60):
        yield


@pytest.fixture(scope="session")
def prepared_data(tmp_path_factory) -> Path:
    """One data set for the session; campaigns copy it (its fingerprint matches their spec)."""
    out = tmp_path_factory.mktemp("data")
    prepare(CampaignSpec(data=DATA).data, out, log=lambda *_: None)
    return out


def small_spec(workdir: Path, **overrides) -> CampaignSpec:
    """A campaign that trains in seconds on 2 CPU workers; overrides replace top-level sections."""
    body = {
        "name": "t", "workdir": str(workdir), "data": DATA,
        "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "max_seq_len": 64},
        "cluster": {"workers_per_node": 2, "max_restarts": 1},
        "stages": [{"name": "warmup", "steps": 6, "seq_len": 32, "micro_batch": 4, "warmup_steps": 2},
                   {"name": "main", "steps": 10, "seq_len": 64, "micro_batch": 4, "grad_accum": 2}],
        "checkpoint": {"interval": 4, "memory_interval": 2, "keep": 2},
        "resume": {"max_attempts": 2},
    }
    body.update(overrides)
    return parse_spec(body)


def seed_data(spec: CampaignSpec, prepared: Path) -> None:
    shutil.copytree(prepared, CampaignLayout(spec.workdir_path).data_dir, dirs_exist_ok=True)


def wait_for(condition, timeout: float, what: str, interval: float = 0.05):
    """Poll ``condition`` until it returns a truthy value; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)  # polling a condition with a deadline, not waiting out a race
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def campaign_processes(workdir: Path, module: str) -> list[psutil.Process]:
    """Live ``python -m <module>`` processes whose command line names the campaign's workdir."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if module in cmd and any(str(workdir) in c for c in cmd):
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except psutil.NoSuchProcess:
                pass
    return found


def worker_processes(workdir: Path) -> list[psutil.Process]:
    return campaign_processes(workdir, "trainer.worker")


def saver_processes(workdir: Path) -> list[psutil.Process]:
    return campaign_processes(workdir, "trainer.saver")


def run_campaign_while(spec, act):
    """Run the campaign in a thread, call ``act()`` meanwhile (e.g. to kill a process);
    returns (the campaign's status, what ``act`` returned)."""
    from concurrent.futures import ThreadPoolExecutor

    from flows.campaign import pretrain_campaign

    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(pretrain_campaign, spec=spec)
        acted = act()
        return run.result(timeout=300), acted



def campaign_events(api_url: str, campaign: str) -> list[dict]:
    """The ``pretrain.*`` events a Prefect server stored for ``campaign``, newest first."""
    import httpx
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    flt = EventFilter(event=EventNameFilter(prefix=["pretrain."]),
                      resource=EventResourceFilter(id=[f"pretrain.campaign.{campaign}"]))
    r = httpx.post(f"{api_url}/events/filter", json={"filter": flt.model_dump(mode="json"), "limit": 50}, timeout=10)
    r.raise_for_status()
    return r.json()["events"]
