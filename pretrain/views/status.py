"""Where a campaign stands, read from its workdir only (ledger + checkpoints)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from pretrain.redact import redact_tree
from pretrain.spec.layout import CampaignLayout
from pretrain.state.ledger import Ledger
from pretrain.state.locations import recorded_checkpoints
from pretrain.views.goodput import ALL, goodput_report
from trainer.checkpoint.store import CheckpointStore


class NoCampaign(FileNotFoundError):
    pass


NO_MLFLOW_RUN = "MLflow: no run yet (the campaign has not opened its MLflow run)"
MLFLOW_BEHIND = (
    "MLflow is behind the campaign (it was away): what its runs lack is sent when the campaign next "
    "finds it answering — `pretrain run` of this campaign again (finished stages are skipped)"
)

STATE_ELSEWHERE = (
    "State: the campaign's ledger is {} (`checkpoint.state_uri`); this workdir keeps a copy, as "
    "last read or written from here (a run from another workdir may have gone further)"
)


def campaign_status(workdir: str | Path, s3_credentials: dict | None = None, live: bool = False) -> dict:
    """Where the campaign in ``workdir`` stands (anything credential-shaped redacted).
    ``s3_credentials``: S3 client arguments for reading its checkpoints (a flow's block credentials);
    ``live``: the caller is the campaign's run (its goodput counts until now)."""
    layout = CampaignLayout(Path(workdir).expanduser().resolve())
    ledger = Ledger.read(layout)
    if ledger is None:
        raise NoCampaign(
            f"no campaign in {layout.root} (no {layout.ledger.name}); start one with `pretrain run --workdir {workdir}`"
        )
    r = ledger.record
    goodput = goodput_report(r, layout, live=live)
    stages = []
    for name, s in r.stages.items():
        where, moved = recorded_checkpoints(layout, name, s.checkpoints)
        store = CheckpointStore.open(where, {**r.storage_options, **(s3_credentials or {})})
        latest, good = store.latest_complete(), store.latest_good()
        entries = s.model_dump(mode="json", include={"verdicts", "resizes", "rewinds", "failures", "resumes"})
        stages.append(
            {
                "name": name,
                "status": s.status.value,
                "steps_total": s.steps,
                "steps_done": good.step if good else 0,  # what a resume would start from
                "latest_checkpoint": latest.to_dict() if latest else None,
                "good_checkpoint": good.to_dict() if good else None,
                "bad_checkpoints": [v for v in entries["verdicts"] if v["verdict"] == "bad"],
                "attempts": s.attempts,
                "restarts": s.restarts,
                "resizes": entries["resizes"],
                "rewinds": entries["rewinds"],
                "problems": ([moved] if moved else []) + store.record_problems(),
                "failures": entries["failures"],
                "resumes": entries["resumes"],
                "mlflow_run_id": s.mlflow_run_id,
                "eval": s.eval,
                "goodput": goodput["stages"][name],
            }
        )
    uri = r.mlflow.tracking_uri
    return redact_tree(
        {
            "campaign": r.campaign,
            "campaign_id": r.campaign_id,
            "workdir": str(layout.root),
            "status": r.status.value,
            "spec_hash": r.spec_hash,
            "invocations": r.invocations,
            "ledger_copy_of": r.copy_of,
            "data": r.data.to_json() if r.data else None,
            "stages": stages,
            "goodput": goodput["campaign"],
            "registered_model": r.registered_model,
            "registration_pending": r.registration_pending,
            "mlflow": {
                **r.mlflow.model_dump(mode="json"),
                "ui_command": f"mlflow ui --backend-store-uri {uri}" if uri.startswith("sqlite:") else f"open {uri}",
            },
        }
    )


def render(status: dict, console: Console | None = None) -> None:
    console = console or Console(width=max(Console().width, 150))
    table = Table(title=f"campaign {status['campaign']} — {status['status']}  ({status['workdir']})")
    for col in (
        "stage",
        "status",
        "steps",
        "latest ckpt",
        "good ckpt",
        "bad ckpts",
        "attempts",
        "restarts",
        "failures",
        "val loss",
        "MLflow run",
    ):
        table.add_column(col, no_wrap=col not in ("failures",))
    for s in status["stages"]:
        table.add_row(
            s["name"],
            s["status"],
            f"{s['steps_done']}/{s['steps_total']}",
            str(s["latest_checkpoint"]["step"]) if s["latest_checkpoint"] else "-",
            str(s["good_checkpoint"]["step"]) if s["good_checkpoint"] else "-",
            ", ".join(str(b["step"]) for b in s["bad_checkpoints"]) or "-",
            str(s["attempts"]),
            str(s["restarts"]),
            ", ".join(f["cause"] for f in s["failures"]) or "-",
            f"{s['eval']['val_loss']:.3f}" if s["eval"] else "-",
            s["mlflow_run_id"] or "-",
        )
    console.print(table)
    for s in status["stages"]:
        for problem in s.get("problems", []):
            console.print(f"stage {s['name']}: {problem}", highlight=False, markup=False)
    console.print(goodput_table(status))
    if (status.get("goodput") or {}).get("known"):
        for note in status["goodput"]["missing"]:
            console.print(f"goodput: {note}", highlight=False, markup=False)
    mlflow = status["mlflow"]
    console.print(
        f"MLflow: parent run {mlflow['parent_run_id']} in experiment '{mlflow['experiment']}' — {mlflow['ui_command']}"
        if mlflow["parent_run_id"]
        else NO_MLFLOW_RUN
    )
    if mlflow.get("behind"):
        console.print(MLFLOW_BEHIND)
    if status.get("ledger_copy_of"):
        console.print(STATE_ELSEWHERE.format(status["ledger_copy_of"]), highlight=False, markup=False)
    if why := status.get("registration_pending"):
        console.print(
            f"Model: not registered yet — {why}; run the campaign again once MLflow answers: it registers "
            "the model and trains nothing again",
            highlight=False,
            markup=False,
        )
    elif reg := status.get("registered_model"):
        console.print(f"Model: {reg['uri']} (version {reg['version']}, from {reg['checkpoint']})")


def _share(part: float, split: dict) -> str:
    return f"{part:.1f}s ({100 * part / split['wall_s']:.0f}%)" if split["wall_s"] else f"{part:.1f}s"


def goodput_table(status: dict) -> Table | str:
    """Where the wall time went (``pretrain.views.goodput``): one row per category, one column per
    stage and the campaign."""
    splits = [(s["name"], s.get("goodput")) for s in status["stages"]] + [("campaign", status.get("goodput"))]
    known = [(name, g) for name, g in splits if g and g.get("known")]
    if not known:
        why = next((g["missing"][0] for _, g in splits if g and g.get("missing")), "no timing recorded yet")
        return f"goodput: unknown — {why}"
    table = Table(title="goodput: where the wall time went")
    table.add_column("")
    for name, _ in known:
        table.add_column(name, justify="right", no_wrap=True)
    table.add_row("goodput", *(f"{100 * g['goodput']:.1f}%" if g["goodput"] is not None else "-" for _, g in known))
    table.add_row("wall", *(f"{g['wall_s']:.1f}s" for _, g in known))
    for c in ALL:
        table.add_row(c.replace("_", " "), *(_share(g["parts_s"].get(c, 0.0), g) for _, g in known))
    return table
