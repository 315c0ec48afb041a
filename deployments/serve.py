"""Serve the campaign flow without a work pool: the programmatic twin of ``prefect.yaml``.

    python -m deployments.serve                      # run on demand only
    python -m deployments.serve --cron "0 2 * * *"   # and every night at 02:00 (UTC by default)

Flow runs are started as subprocesses of this process (Ctrl-C stops serving; the deployment
stays and its schedule pauses). Trigger a run with
``prefect deployment run pretrain-campaign/pretrain-campaign``.
"""

from __future__ import annotations

import argparse

from prefect import serve
from prefect.deployments.runner import RunnerDeployment
from prefect.schedules import Cron

from deployments import definitions
from flows.campaign import pretrain_campaign

DEPLOYMENT_NAME = definitions.campaign().name


def build_deployment(
    spec_path: str = "builtin:tiny", cron: str | None = None, timezone: str = "UTC"
) -> RunnerDeployment:
    """The campaign deployment: at most one run at a time (runs of one spec share a workdir)."""
    d = definitions.campaign(spec_path)
    return pretrain_campaign.to_deployment(
        name=d.name,
        description=d.description,
        tags=d.tags,
        parameters=d.parameters,
        schedules=[Cron(cron, timezone=timezone)] if cron else None,
        concurrency_limit=d.concurrency_limit,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m deployments.serve", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--spec-path",
        default="builtin:tiny",
        help="default campaign spec: a YAML file or builtin:<name> (default: %(default)s)",
    )
    parser.add_argument("--cron", default=None, help="also run on this cron schedule, e.g. '0 2 * * *'")
    parser.add_argument("--timezone", default="UTC", help="time zone of --cron (default: %(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    serve(build_deployment(args.spec_path, args.cron, args.timezone))


if __name__ == "__main__":
    main()
