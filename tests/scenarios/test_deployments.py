"""prefect.yaml, deployments/serve.py and deployments/deploy.py: entrypoints are real flows, the
campaign runs one at a time, the evaluation deployment has its trigger, and the three say the
same. (``prefect deploy --all`` against a real server: tests/scenarios/test_prefect_server.py.)"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml
from prefect import Flow

from deployments import definitions
from deployments.deploy import ROOT as DEPLOY_ROOT
from deployments.deploy import build_deployments, source_of
from deployments.serve import build_deployment, parse_args

ROOT = Path(__file__).resolve().parents[2]
PROJECT = yaml.safe_load((ROOT / "prefect.yaml").read_text())
DEPLOYMENTS = {d["name"]: d for d in PROJECT["deployments"]}
LOCAL = ["pretrain-campaign", "prepare-data", "evaluate-checkpoint", "compare-campaigns"]


def load_entrypoint(entrypoint: str) -> Flow:
    path, _, func = entrypoint.partition(":")
    assert (ROOT / path).is_file(), f"{path} does not exist"
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    return getattr(module, func)


def test_project_file_shape():
    assert PROJECT["name"] == "prefect-pretrain"
    assert set(DEPLOYMENTS) == {*LOCAL, "kubernetes", "advance-campaign"}
    [step] = PROJECT["pull"]
    assert step == {"prefect.deployments.steps.set_working_directory": {"directory": "{{ $PWD }}"}}


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_entrypoint_is_a_prefect_flow(name):
    obj = load_entrypoint(DEPLOYMENTS[name]["entrypoint"])
    assert isinstance(obj, Flow)
    assert set(DEPLOYMENTS[name].get("parameters", {})) <= set(obj.parameters.properties)


@pytest.mark.parametrize("name", LOCAL)
def test_local_deployments_use_the_process_pool(name):
    assert DEPLOYMENTS[name]["work_pool"] == {
        "name": "local-process",
        "work_queue_name": "default",
        "job_variables": {},
    }


def test_campaign_deployment_runs_one_at_a_time_and_schedule_starts_paused():
    campaign = DEPLOYMENTS["pretrain-campaign"]
    assert campaign["entrypoint"] == "flows/campaign.py:pretrain_campaign"
    assert campaign["concurrency_limit"] == 1
    assert campaign["parameters"] == {"spec_path": "builtin:tiny"}
    assert campaign["schedules"] and all(s["active"] is False for s in campaign["schedules"])


def test_nightly_deployment_advances_the_campaign_one_time_boxed_run_at_a_time():
    """A night's run pauses within its budget; a run still going when the next is due keeps the
    campaign, the newcomer is cancelled (not queued behind it)."""
    from pretrain.run.budget import parse_duration

    nightly = DEPLOYMENTS["advance-campaign"]
    assert nightly["entrypoint"] == DEPLOYMENTS["pretrain-campaign"]["entrypoint"]
    assert nightly["concurrency_limit"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}
    assert nightly["work_pool"] == DEPLOYMENTS["pretrain-campaign"]["work_pool"]
    assert parse_duration(nightly["parameters"]["run_for"]) < 24 * 3600  # over before the next night starts
    [night] = nightly["schedules"]
    assert night["cron"] == "0 1 * * *" and night["active"] is False


def test_prepare_data_prepares_the_campaigns_spec():
    # Same spec (so same workdir and spec hash) as pretrain-campaign: the ledger refuses any other.
    assert DEPLOYMENTS["prepare-data"]["parameters"] == DEPLOYMENTS["pretrain-campaign"]["parameters"]


def test_evaluation_runs_on_good_checkpoints():
    dep = DEPLOYMENTS["evaluate-checkpoint"]
    assert dep["entrypoint"] == "flows/evaluate_checkpoint.py:evaluate_checkpoint"
    flow = load_entrypoint(dep["entrypoint"])
    assert flow.name == "evaluate-checkpoint" and flow.parameters.required == ["checkpoint"]
    [trigger] = dep["triggers"]
    expected = definitions.evaluate_on_good_checkpoint()
    assert trigger["expect"] == sorted(expected.expect) == ["pretrain.checkpoint.good"]
    assert trigger["match"] == expected.match.model_dump()
    assert trigger["parameters"] == expected.parameters and trigger["enabled"]


def test_kubernetes_example_clones_the_repository():
    k8s = DEPLOYMENTS["kubernetes"]
    assert k8s["entrypoint"] == DEPLOYMENTS["pretrain-campaign"]["entrypoint"] and k8s["concurrency_limit"] == 1
    [clone] = k8s["pull"]
    assert clone["prefect.deployments.steps.git_clone"]["repository"].endswith(".git")
    assert k8s["work_pool"]["name"] == "kubernetes"
    assert {"image", "namespace", "env"} <= set(k8s["work_pool"]["job_variables"])


def test_kubernetes_flow_runs_as_the_deployed_service_account():
    """The flow-run pod (the orchestrator) runs as the ServiceAccount of deploy/kubernetes/rbac.yaml,
    in its namespace: the account whose Role preflight checks."""
    docs = list(yaml.safe_load_all((ROOT / "deploy/kubernetes/rbac.yaml").read_text()))
    account = next(d["metadata"] for d in docs if d["kind"] == "ServiceAccount")
    variables = DEPLOYMENTS["kubernetes"]["work_pool"]["job_variables"]
    assert (variables["service_account_name"], variables["namespace"]) == (account["name"], account["namespace"])


def test_serve_matches_the_project_file():
    campaign = DEPLOYMENTS["pretrain-campaign"]
    dep = build_deployment()
    assert (dep.name, dep.entrypoint, dep.parameters) == (
        campaign["name"],
        campaign["entrypoint"],
        campaign["parameters"],
    )
    assert dep.concurrency_limit == 1 and not dep.schedules
    scheduled = build_deployment(**vars(parse_args(["--cron", "0 2 * * *", "--timezone", "Europe/Paris"])))
    [sched] = scheduled.schedules
    assert (sched.schedule.cron, sched.schedule.timezone, sched.active) == ("0 2 * * *", "Europe/Paris", True)


def test_deploy_matches_the_project_file():
    built = {d.name: d for d in build_deployments(source_of(), cron="0 2 * * *")}
    assert set(built) == set(LOCAL)
    for name, dep in built.items():
        want = DEPLOYMENTS[name]
        assert (dep.entrypoint, dep.parameters, dep.tags) == (
            want["entrypoint"],
            want.get("parameters", {}),
            want["tags"],
        )
        assert dep.concurrency_limit == want.get("concurrency_limit")
        assert dep.storage.to_pull_step() == {
            "prefect.deployments.steps.set_working_directory": {"directory": str(DEPLOY_ROOT)}
        }
    [trigger] = built["evaluate-checkpoint"].triggers
    assert trigger.expect == {"pretrain.checkpoint.good"}
    assert [s.schedule.cron for s in built["pretrain-campaign"].schedules] == ["0 2 * * *"]


def test_no_two_tasks_or_flows_share_a_name():
    """The UI, the logs and automations find runs by name: a task named like a flow is ambiguous."""
    from prefect import Task

    names: dict[str, str] = {}
    for package in ("flows", "tasks"):
        for path in sorted((ROOT / package).glob("*.py")):
            module = importlib.import_module(f"{package}.{path.stem}")
            for attr, obj in vars(module).items():
                if isinstance(obj, (Flow, Task)) and obj.__module__ == module.__name__:
                    where = f"{module.__name__}.{attr}"
                    assert names.setdefault(obj.name, where) == where, f"{obj.name!r}: {names[obj.name]} and {where}"
