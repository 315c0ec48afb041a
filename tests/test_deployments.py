"""prefect.yaml and deployments/serve.py: entrypoints are real flows, the campaign runs one at
a time, and ``prefect deploy --all`` really creates both deployments on a (test) server."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prefect import Flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectAlreadyExists
from prefect.settings import PREFECT_API_URL

from deployments.serve import build_deployment, parse_args

ROOT = Path(__file__).resolve().parents[1]
PROJECT = yaml.safe_load((ROOT / "prefect.yaml").read_text())
DEPLOYMENTS = {d["name"]: d for d in PROJECT["deployments"]}


def load_entrypoint(entrypoint: str) -> Flow:
    path, _, func = entrypoint.partition(":")
    assert (ROOT / path).is_file(), f"{path} does not exist"
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    return getattr(module, func)


def test_project_file_shape():
    assert PROJECT["name"] == "prefect-pretrain"
    assert set(DEPLOYMENTS) == {"pretrain-campaign", "prepare-data"}
    [step] = PROJECT["pull"]
    assert step == {"prefect.deployments.steps.set_working_directory": {"directory": "{{ $PWD }}"}}


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_entrypoint_is_a_prefect_flow(name):
    obj = load_entrypoint(DEPLOYMENTS[name]["entrypoint"])
    assert isinstance(obj, Flow)
    assert set(DEPLOYMENTS[name].get("parameters", {})) <= set(obj.parameters.properties)
    assert DEPLOYMENTS[name]["work_pool"]["name"] == "local-process"


def test_campaign_deployment_runs_one_at_a_time_and_schedule_starts_paused():
    campaign = DEPLOYMENTS["pretrain-campaign"]
    assert campaign["entrypoint"] == "flows/campaign.py:pretrain_campaign"
    assert campaign["concurrency_limit"] == 1
    assert campaign["parameters"] == {"spec_path": "builtin:tiny"}
    assert campaign["schedules"] and all(s["active"] is False for s in campaign["schedules"])


def test_prepare_data_prepares_the_campaigns_spec():
    # Same spec (so same workdir and spec hash) as pretrain-campaign: the ledger refuses any other.
    assert DEPLOYMENTS["prepare-data"]["parameters"] == DEPLOYMENTS["pretrain-campaign"]["parameters"]


def test_serve_matches_the_project_file():
    campaign = DEPLOYMENTS["pretrain-campaign"]
    dep = build_deployment()
    assert (dep.name, dep.entrypoint, dep.parameters) == (campaign["name"], campaign["entrypoint"], campaign["parameters"])
    assert dep.concurrency_limit == 1 and not dep.schedules
    scheduled = build_deployment(**vars(parse_args(["--cron", "0 2 * * *", "--timezone", "Europe/Paris"])))
    [sched] = scheduled.schedules
    assert (sched.schedule.cron, sched.schedule.timezone, sched.active) == ("0 2 * * *", "Europe/Paris", True)


def test_prefect_deploy_all(prefect_harness, tmp_path):
    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name="local-process", type="process"))
        except ObjectAlreadyExists:
            pass
    env = {**os.environ, "PWD": str(ROOT), "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with get_client(sync_client=True) as client:
        campaign = client.read_deployment_by_name("pretrain-campaign/pretrain-campaign")
        prepare = client.read_deployment_by_name("prepare-data/prepare-data")
    assert campaign.global_concurrency_limit.limit == 1
    assert [(s.schedule.cron, s.active) for s in campaign.schedules] == [("0 2 * * *", False)]
    assert campaign.parameters == {"spec_path": "builtin:tiny"}
    for dep in (campaign, prepare):
        assert dep.work_pool_name == "local-process"
        assert dep.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
