"""Create the deployments on a work pool from Python: the programmatic twin of ``prefect.yaml``.

    python -m deployments.deploy                                   # code from this checkout, process pool
    python -m deployments.deploy --git https://github.com/org/prefect-pretrain.git --branch main
    python -m deployments.deploy --pool kubernetes --image ghcr.io/org/prefect-pretrain:latest \\
        --git https://github.com/org/prefect-pretrain.git

Workers of the pool pick the runs up (``prefect worker start --pool local-process``). With
``--git`` each flow run clones the repository first, so the worker needs no checkout.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from prefect import Flow, deploy
from prefect.deployments.runner import RunnerDeployment
from prefect.runner.storage import GitRepository
from prefect.schedules import Cron

from deployments import definitions

ROOT = Path(__file__).resolve().parents[1]


def source_of(git: str | None = None, branch: str | None = None) -> str | GitRepository:
    """Where workers get the code: a git repository (cloned per flow run) or this checkout."""
    return GitRepository(url=git, branch=branch) if git else str(ROOT)


def to_deployment(d: definitions.Definition, source, **kwargs) -> RunnerDeployment:
    flow = Flow.from_source(source=source, entrypoint=d.entrypoint)
    return flow.to_deployment(
        name=d.name,
        description=d.description,
        tags=d.tags,
        parameters=d.parameters,
        concurrency_limit=d.concurrency_limit,
        **kwargs,
    )


def build_deployments(
    source,
    spec_path: str = "builtin:tiny",
    cron: str | None = None,
    timezone: str = "UTC",
    job_variables: dict | None = None,
) -> list[RunnerDeployment]:
    """Campaign (optionally on a cron schedule), data preparation, checkpoint evaluation (run
    by the ``pretrain.checkpoint.good`` trigger) and the comparison of campaigns."""
    extra = {"job_variables": job_variables} if job_variables else {}
    return [
        to_deployment(
            definitions.campaign(spec_path),
            source,
            schedules=[Cron(cron, timezone=timezone)] if cron else None,
            **extra,
        ),
        to_deployment(definitions.prepare_data(spec_path), source, **extra),
        to_deployment(
            definitions.evaluate_checkpoint(), source, triggers=[definitions.evaluate_on_good_checkpoint()], **extra
        ),
        to_deployment(definitions.compare_campaigns(), source, **extra),
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m deployments.deploy", description=__doc__.splitlines()[0])
    parser.add_argument("--pool", default="local-process", help="work pool name (default: %(default)s)")
    parser.add_argument("--git", default=None, help="clone the code from this git repository in every flow run")
    parser.add_argument("--branch", default=None, help="branch of --git (default: the repository's default)")
    parser.add_argument("--image", default=None, help="container image with the dependencies (Kubernetes pools)")
    parser.add_argument("--spec-path", default="builtin:tiny", help="default campaign spec (default: %(default)s)")
    parser.add_argument("--cron", default=None, help="run the campaign on this cron schedule, e.g. '0 2 * * *'")
    parser.add_argument("--timezone", default="UTC", help="time zone of --cron (default: %(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list:
    args = parse_args(argv)
    deployments = build_deployments(source_of(args.git, args.branch), args.spec_path, args.cron, args.timezone)
    return deploy(
        *deployments,
        work_pool_name=args.pool,
        image=args.image,
        build=False,
        push=False,
        print_next_steps_message=False,
    )


if __name__ == "__main__":
    main()
