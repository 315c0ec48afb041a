"""The jobs' records of a campaign whose state is on shared storage, copied there after each
job and restored into a workdir that lacks them (``pretrain.state.job_records``). Best effort: the
records are for goodput detail and reading; storage away is one warning, and the next job's end
catches up."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pretrain.redact import redact
from pretrain.spec.campaign import CampaignSpec
from pretrain.state.guard import held, state_location, state_storage
from pretrain.state.job_records import Copied, keep_records, restore_records
from pretrain.state.lease import LeaseLost


@task(name="keep-job-records", cache_policy=NO_CACHE)
def keep_job_records(spec: CampaignSpec) -> list[str]:
    """Copy the workdir's job records that ``checkpoint.state_uri`` lacks (or holds shorter)
    there; the keys copied."""
    mine = held(spec)
    try:
        if mine is not None:
            mine.check()  # a run whose lease was taken over writes no more of the campaign's state
    except LeaseLost as lost:
        get_run_logger().warning("the jobs' records are not copied to %s: %s", redact(state_location(spec)), lost)
        return []
    return _sync(spec, keep_records, "copy the jobs' records to", "the next job's end tries again")


@task(name="restore-job-records", cache_policy=NO_CACHE)
def restore_job_records(spec: CampaignSpec) -> list[str]:
    """Copy the job records at ``checkpoint.state_uri`` the workdir lacks into it (a run on
    another machine, or after the orchestrator's disk was lost); the keys copied."""
    files = _sync(spec, restore_records, "restore the jobs' records from", "goodput leaves out what they hold")
    if files:
        get_run_logger().info(
            "restored %d job record file(s) from %s into the workdir", len(files), redact(state_location(spec))
        )
    return files


def _sync(spec: CampaignSpec, sync, what: str, then: str) -> list[str]:
    where = state_location(spec)
    if where is None:
        return []
    try:
        done: Copied = sync(state_storage(spec), spec.workdir_path)
    except (OSError, RuntimeError) as err:  # storage away (StorageError is a RuntimeError), workdir unwritable
        get_run_logger().warning("could not %s %s (%s); %s", what, redact(where), redact(str(err)), then)
        return []
    if done.failed:
        key, why = done.failed[0]
        get_run_logger().warning(
            "could not %s %s: %d file(s), e.g. %s (%s); %s",
            what,
            redact(where),
            len(done.failed),
            key,
            redact(why),
            then,
        )
    return done.files
