"""``pretrain stacks``: where each live worker of a campaign's running job is now, from another
terminal: every thread's Python stack, taken with the signal the hang detector uses
(``trainer.resilience.stacks``; the workers keep running). Workers on this machine only."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import psutil
import typer

from pretrain.cli.errors import err, refused
from trainer.resilience.heartbeat import heartbeat_dir
from trainer.resilience.stacks import stack_path, take_dump, where

WORKER_MODULE = "trainer.worker"


@dataclass
class LiveWorker:
    job_dir: Path
    heartbeat: Path
    record: dict  # its newest heartbeat: rank, pid, phase, step

    @property
    def name(self) -> str:
        stage, attempt = self.job_dir.parent.name, self.job_dir.name.removeprefix("attempt_")
        r = self.record
        return (
            f"stage {stage} attempt {int(attempt)} rank {r.get('rank')} (pid {r.get('pid')}, step {r.get('step')}, "
            f"in '{r.get('phase')}')"
        )


def live_workers(workdir: Path) -> list[LiveWorker]:
    """The workers of the campaign's jobs running on this machine: a heartbeat record whose
    process lives and is a worker of that job (a pid reused by another process is not one)."""
    found = []
    for job_dir in sorted(workdir.glob("jobs/*/attempt_*")):
        for path in sorted(heartbeat_dir(job_dir).glob("agent*-local*.json")):
            try:
                record = json.loads(path.read_text())
                pid = int(record["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being replaced, or damaged: not a worker to ask
            if _is_worker_of(pid, job_dir):
                found.append(LiveWorker(job_dir, path, record))
    return found


def _is_worker_of(pid: int, job_dir: Path) -> bool:
    try:
        cmdline = psutil.Process(pid).cmdline()
    except psutil.Error:
        return False
    return WORKER_MODULE in cmdline and any(str(job_dir) in arg for arg in cmdline)


def stacks(
    workdir: Path | None = typer.Option(
        None,
        "--workdir",
        "-w",
        help="The campaign's workdir (default: the one campaign in ./runs, where `pretrain run` puts it).",
    ),
    full: bool = typer.Option(False, "--full", help="Print every thread's stack, not only where each worker is."),
) -> None:
    """Show where each live worker of a running campaign is (its threads' stacks; it keeps running)."""
    from pretrain.cli.workdir_lookup import pick_workdir
    from pretrain.views.status import NoCampaign

    with refused(NoCampaign):
        workdir = pick_workdir(workdir).expanduser().resolve()
    workers = live_workers(workdir)
    if not workers:
        err.print(
            f"no live worker of the campaign in {workdir} on this machine (its job is not running here; on "
            "Kubernetes run this in a training pod)",
            highlight=False,
        )
        raise typer.Exit(1)
    for w in workers:
        text = take_dump(int(w.record["pid"]), stack_path(w.heartbeat))
        typer.echo(f"{w.name}: {where(text) or 'no stack written (it may have just ended)'}")
        if full and text:
            typer.echo(text.rstrip() + "\n")
