"""Campaigns side by side, read from MLflow: tokens seen, eval loss, goodput, wall time, restarts,
rollbacks, checkpoint blocking and the parameters that differ (``pretrain compare``, the
``compare-campaigns`` flow).

A campaign is named by its workdir (its ledger says which store and run), its MLflow campaign
run id, or its name (the campaign run tagged with it). Everything shown comes from the campaign's
MLflow runs (docs/tracking.md lists the keys); restarts and rollbacks, which a campaign logs when
it completes, come from its ledger while it has not (when the workdir is readable here).
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from sqlalchemy.exc import SQLAlchemyError

from pretrain.redact import redact
from pretrain.spec.layout import CampaignLayout
from pretrain.state.ledger import Ledger, LedgerError
from pretrain.state.schema import CampaignRecord
from pretrain.tracking.runs import (
    TAG_CAMPAIGN,
    TAG_CAMPAIGN_ID,
    TAG_ROLE,
    TAG_STAGE,
    TAG_WORKDIR,
    describe_error,
    transient,
)
from pretrain.tracking.store import recorded_store, sqlite_path

EVAL_LOSS = "val_loss"
ROLLBACK_CAUSES = ("nonfinite_loss", "loss_spike")  # loss anomalies: rolled back to a good checkpoint and skipped
COUNTERS = ("restarts", "rollbacks")  # logged to the campaign run when it completes
RUN_ID = re.compile(r"^[0-9a-f]{32}$")
MISSING = "—"


class CompareError(ValueError):
    """A campaign to compare cannot be found or read; the message says which and what to do."""


@dataclass
class CampaignSummary:
    """One campaign's column of the comparison (None: not known)."""

    label: str  # as the user named it
    campaign: str
    run_id: str
    tracking_uri: str  # redacted
    status: str
    tokens_seen: float | None = None
    final_eval_loss: float | None = None
    best_eval_loss: float | None = None
    goodput: float | None = None
    wall_time_s: float | None = None
    restarts: int | None = None
    rollbacks: int | None = None
    checkpoint_stall_s: float | None = None
    params: dict[str, str] = field(default_factory=dict)  # campaign params; stage params as <stage>.<key>
    eval_curve: list[tuple[float, float]] = field(default_factory=list)  # (tokens seen, eval loss)

    def to_json(self) -> dict:
        return asdict(self)


def ledger_counters(record: CampaignRecord) -> dict[str, int]:
    """Restarts (in-job restarts and job relaunches) and rollbacks (loss anomalies skipped) of a campaign."""
    stages = record.stages.values()
    return {
        "restarts": sum(s.restarts + max(0, s.attempts - 1) for s in stages),
        "rollbacks": sum(1 for s in stages for f in s.failures if f.cause in ROLLBACK_CAUSES),
    }


@dataclass
class Target:
    """Where a campaign to compare is: its store and campaign run, and its ledger if readable here."""

    label: str
    tracking_uri: str
    run_id: str
    record: CampaignRecord | None = None


def resolve(label: str, tracking_uri: str) -> Target:
    """A workdir, a campaign run id or a campaign name → its store and run (``tracking_uri``: the
    store to look in for ids and names)."""
    path = Path(label).expanduser()
    if path.is_dir() and CampaignLayout(path).ledger.exists():
        return _from_workdir(label, path, tracking_uri)
    client = _client(tracking_uri)
    if RUN_ID.match(label):
        return Target(label, tracking_uri, label)
    flt = f"tags.`{TAG_CAMPAIGN}` = '{label}' AND tags.`{TAG_ROLE}` = 'campaign'"
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, filter_string=flt, max_results=20) if experiments else []
    if not runs:
        where = f"{label} holds no campaign (no ledger.json)" if path.is_dir() else f"{label!r} is no workdir here"
        raise CompareError(
            f"{where} and no campaign of that name is in {redact(tracking_uri)}: "
            "give its workdir, its MLflow run id, or the store with --tracking-uri"
        )
    if len({r.data.tags.get(TAG_CAMPAIGN_ID) for r in runs}) > 1:
        ids = ", ".join(r.info.run_id for r in runs)
        raise CompareError(
            f"several campaigns are named {label!r} in {redact(tracking_uri)} (runs {ids}): "
            "give the run id or the workdir of the one you mean"
        )
    return Target(label, tracking_uri, runs[0].info.run_id)


def _client(tracking_uri: str) -> MlflowClient:
    """A client of the store; a sqlite store that does not exist is an error (MLflow would create it)."""
    db = sqlite_path(tracking_uri)
    if db is not None and not db.is_file():
        raise CompareError(
            f"there is no MLflow store at {db}: run this where the campaigns were run, or give "
            "their store with --tracking-uri (or MLFLOW_TRACKING_URI), or their workdirs"
        )
    return MlflowClient(tracking_uri)


def _from_workdir(label: str, path: Path, tracking_uri: str) -> Target:
    try:
        ledger = Ledger.read(CampaignLayout(path.resolve()))
    except LedgerError as err:
        raise CompareError(f"{label}: {err}") from None
    if ledger is None:  # gone since resolve() looked
        raise CompareError(f"{label} holds no campaign (no ledger.json): give a campaign's workdir, run id or name")
    run_id = ledger.record.mlflow.parent_run_id
    if run_id is None:
        raise CompareError(f"campaign {ledger.record.campaign!r} in {label} has no MLflow run yet: run it first")
    return Target(label, recorded_store(ledger.record.mlflow.tracking_uri) or tracking_uri, run_id, ledger.record)


def _history(client: MlflowClient, run_id: str, key: str) -> list:
    return sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))


def _at(history: list, step: int) -> float | None:
    """The value of ``history`` at the newest step <= ``step``."""
    before = [m for m in history if m.step <= step]
    return before[-1].value if before else None


def summarize(target: Target) -> CampaignSummary:
    """Read the campaign's numbers from its MLflow runs (``MlflowException`` / ``OSError`` if the
    store cannot be read: :func:`compare` says so)."""
    client = _client(target.tracking_uri)
    run = client.get_run(target.run_id)
    tags, metrics = run.data.tags, run.data.metrics
    if tags.get(TAG_ROLE) != "campaign":
        raise CompareError(
            f"{target.label}: MLflow run {target.run_id} is not a campaign's run (tag {TAG_ROLE} is "
            f"{tags.get(TAG_ROLE)!r}); give the campaign run's id (its stage runs are nested under it)"
        )
    record = target.record or ledger_of(tags.get(TAG_WORKDIR), tags.get(TAG_CAMPAIGN_ID))
    tokens, evals = _history(client, run.info.run_id, "tokens_seen"), _history(client, run.info.run_id, EVAL_LOSS)
    stages = client.search_runs(
        [run.info.experiment_id],
        filter_string=(f"tags.`{TAG_CAMPAIGN_ID}` = '{tags.get(TAG_CAMPAIGN_ID)}' AND tags.`{TAG_ROLE}` = 'stage'"),
    )
    params = dict(run.data.params)
    for stage in stages:
        name = stage.data.tags.get(TAG_STAGE, stage.info.run_id)
        params.update({f"{name}.{k.removeprefix('stage.')}": v for k, v in stage.data.params.items()})
    stall = [m.value for s in stages for m in client.get_metric_history(s.info.run_id, "checkpoint_block_s")]
    counters = ledger_counters(record) if record is not None else {}
    goodput_wall = metrics.get("goodput_wall_s")  # the measured runs' wall time (idle time between runs excluded)
    end = run.info.end_time or int(time.time() * 1000)
    return CampaignSummary(
        label=target.label,
        campaign=tags.get(TAG_CAMPAIGN, run.info.run_name or ""),
        run_id=run.info.run_id,
        tracking_uri=redact(target.tracking_uri),
        status=run.info.status,
        tokens_seen=tokens[-1].value if tokens else None,
        final_eval_loss=evals[-1].value if evals else None,
        best_eval_loss=min(m.value for m in evals) if evals else None,
        goodput=metrics.get("goodput"),
        wall_time_s=goodput_wall if goodput_wall is not None else (end - run.info.start_time) / 1000,
        restarts=_count(metrics, counters, "restarts"),
        rollbacks=_count(metrics, counters, "rollbacks"),
        checkpoint_stall_s=sum(stall),
        params=params,
        eval_curve=[(t, m.value) for m in evals if (t := _at(tokens, m.step)) is not None],
    )


def _count(metrics: dict, counters: dict, key: str) -> int | None:
    if key in metrics:
        return int(metrics[key])
    return counters.get(key)


def ledger_of(workdir: str | None, campaign_id: str | None) -> CampaignRecord | None:
    """The ledger of the campaign run's workdir, if it is readable here and is that campaign's."""
    if not workdir:
        return None
    try:
        ledger = Ledger.read(CampaignLayout(Path(workdir)))
    except (LedgerError, OSError):
        return None
    return ledger.record if ledger and ledger.record.campaign_id == campaign_id else None


def compare(labels: list[str], tracking_uri: str) -> list[CampaignSummary]:
    """The summaries of the campaigns ``labels`` name, in that order."""
    out = []
    for label in labels:
        uri = tracking_uri
        try:
            target = resolve(label, tracking_uri)
            uri = target.tracking_uri
            out.append(summarize(target))
        except SQLAlchemyError as err:  # a damaged or foreign sqlite file where the store should be
            raise CompareError(
                f"{label}: the MLflow store at {redact(uri)} cannot be read ({describe_error(err, 160)}): "
                "is it an MLflow database? Give the campaigns' store with --tracking-uri"
            ) from None
        except (MlflowException, OSError) as err:
            if transient(err):  # unreachable, timing out, failing on its side
                raise CompareError(
                    f"{label}: MLflow at {redact(uri)} cannot be reached ({describe_error(err, 160)}); "
                    "start it, or give the right --tracking-uri"
                ) from None
            raise CompareError(
                f"{label}: cannot read it from MLflow at {redact(uri)} ({describe_error(err, 160)}); "
                "check the run id and the store (--tracking-uri)"
            ) from None
    return out


def same_campaign_notes(summaries: list[CampaignSummary]) -> list[str]:
    """A note for each campaign named more than once (its workdir and its run id, or a workdir
    and a copy of it: a copied workdir keeps its campaign's id and MLflow runs)."""
    labels: dict[tuple[str, str], list[str]] = {}
    for s in summaries:
        labels.setdefault((s.tracking_uri, s.run_id), []).append(s.label)
    return [
        f"{', '.join(named[:-1])} and {named[-1]} are the same campaign (MLflow run {run_id}): a workdir "
        "copied from another keeps its campaign and its MLflow runs"
        for (_, run_id), named in labels.items()
        if len(named) > 1
    ]
