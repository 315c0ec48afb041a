"""A campaign's report, read from its workdir only (ledger + checkpoint stores): the tables the
Prefect artifacts show, and the markdown campaign report. No Prefect here."""

from __future__ import annotations

import html
from collections import defaultdict
from pathlib import Path

from pretrain.redact import redact, redact_tree
from pretrain.run.incidents import where_hung
from pretrain.spec.layout import CampaignLayout
from pretrain.state.ledger import Ledger
from pretrain.state.locations import recorded_checkpoints
from pretrain.views.goodput import ALL, DESCRIPTIONS
from pretrain.views.status import MLFLOW_BEHIND, NO_MLFLOW_RUN, STATE_ELSEWHERE, campaign_status
from trainer.checkpoint.store import GOOD, CheckpointStore

NODE_CHECK_COLUMNS = ("node", "local_rank", "matmul_s", "relative", "allreduce_MBps", "excluded", "error")


def checkpoint_rows(workdir: str | Path, s3_credentials: dict | None = None) -> list[dict]:
    """One row per stored checkpoint of every stage, oldest first: its verdict (good / bad /
    unvalidated), whether it is the stage's good checkpoint, and its evaluation loss if evaluated
    (anything credential-shaped redacted). ``s3_credentials``: S3 client arguments for the reads."""
    layout = CampaignLayout(Path(workdir).expanduser().resolve())
    ledger = Ledger.read(layout)
    if ledger is None:
        return []
    rows = []
    for name, stage in ledger.record.stages.items():
        where, _ = recorded_checkpoints(layout, name, stage.checkpoints)
        store = CheckpointStore.open(where, {**ledger.record.storage_options, **(s3_credentials or {})})
        good = store.read_pointer(GOOD)
        evaluated = stage.eval or {}
        for step in sorted(store.committed_steps()):
            verdict = store.verdict(step) or {}
            rows.append(
                {
                    "stage": name,
                    "step": step,
                    "verdict": verdict.get("verdict", "unvalidated"),
                    "good_pointer": step == good,
                    "eval_loss": round(evaluated["val_loss"], 4) if evaluated.get("step") == step else None,
                    "problems": "; ".join(verdict.get("problems", [])) or None,
                    "path": store.ref(step).location,
                }
            )
    return redact_tree(rows)


def node_check_rows(health: list[dict]) -> list[dict]:
    """The node check's rows (a ledger's ``cluster.health``) as table rows."""
    return [{k: r.get(k) for k in NODE_CHECK_COLUMNS} for r in health]


def time_lost_by_cause(status: dict) -> dict[str, float]:
    """Seconds of work lost per failure cause, over every stage (biggest first)."""
    lost: dict[str, float] = defaultdict(float)
    for stage in status["stages"]:
        for f in stage["failures"]:
            lost[f.get("cause") or "unknown"] += float(f.get("time_lost_s") or 0.0)
    return dict(sorted(lost.items(), key=lambda kv: -kv[1]))


def _table(rows: list[dict], columns: list[str] | tuple[str, ...]) -> list[str]:
    if not rows:
        return ["_none_", ""]

    def cell(v) -> str:
        text = "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
        return text.replace("|", "\\|").replace("\n", " ")

    return [
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
        *("| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows),
        "",
    ]


def goodput_rows(status: dict) -> list[dict]:
    """One row per category of the goodput split: seconds per stage and for the campaign."""
    splits = [(s["name"], s.get("goodput") or {}) for s in status["stages"]] + [
        ("campaign", status.get("goodput") or {})
    ]
    splits = [(name, g) for name, g in splits if g.get("known")]
    if not splits:
        return []
    rows = [
        {
            "category": "goodput",
            **{n: f"{100 * g['goodput']:.1f} %" if g["goodput"] is not None else None for n, g in splits},
        },
        {"category": "wall (s)", **{n: round(g["wall_s"], 2) for n, g in splits}},
    ]
    return rows + [
        {"category": c, **{n: round(g["parts_s"].get(c, 0.0), 2) for n, g in splits}, "what": DESCRIPTIONS[c]}
        for c in ALL
    ]


def campaign_report(
    workdir: str | Path,
    s3_credentials: dict | None = None,
    status: dict | None = None,
    images: dict[str, str] | None = None,
) -> str:
    """Markdown: where the campaign stands, its stages and attempts, where the wall time went
    (goodput), every checkpoint with its verdict and eval loss, the node check, failures and the
    time lost per cause (redacted). ``status``: the campaign's status, when the caller has just
    computed it; ``images``: pictures to embed (title → URL)."""
    status = status or campaign_status(workdir, s3_credentials)
    ledger = Ledger.read(CampaignLayout(Path(status["workdir"])))
    lines = _summary_lines(status, ledger)
    lines += ["", "## Stages", ""]
    lines += _stage_lines(status)
    lines += ["## Goodput: where the wall time went", ""]
    lines += _goodput_lines(status)
    lines += _image_lines(images, status["workdir"]) if images else []
    lines += ["## Checkpoints", ""]
    lines += _table(
        checkpoint_rows(status["workdir"], s3_credentials),
        ("stage", "step", "verdict", "good_pointer", "eval_loss", "problems"),
    )
    lines += ["## Node check", ""]
    lines += _table(node_check_rows(ledger.record.node_health() if ledger else []), NODE_CHECK_COLUMNS)
    lines += ["## Time lost per cause", ""]
    lost = [{"cause": c, "seconds": round(s, 2)} for c, s in time_lost_by_cause(status).items()]
    lines += _table(lost, ("cause", "seconds"))
    lines += ["## Failures", ""]
    lines += _failure_lines(status)
    return redact("\n".join(lines))


def _summary_lines(status: dict, ledger: Ledger | None) -> list[str]:
    """The report's title and where the campaign stands: workdir, spec, MLflow, how it ended."""
    end = ledger.record.end if ledger else None
    lines = [
        f"# Campaign `{status['campaign']}` — {status['status']}",
        "",
        f"- workdir: `{status['workdir']}`",
        f"- spec hash: `{status['spec_hash']}`, runs of the campaign flow: {status['invocations']}",
        f"- MLflow: parent run `{status['mlflow']['parent_run_id']}` in experiment "
        f"`{status['mlflow']['experiment']}` (`{status['mlflow']['ui_command']}`)"
        if status["mlflow"]["parent_run_id"]
        else f"- {NO_MLFLOW_RUN}",
    ]
    if status["mlflow"].get("behind"):
        lines.append(f"- {MLFLOW_BEHIND}")
    if status.get("ledger_copy_of"):
        lines.append(f"- {STATE_ELSEWHERE.format(status['ledger_copy_of'])}")
    if end is not None and end.cause and status["status"] != "completed":
        lines.append(f"- ended {end.state.lower()}: {end.cause}")
    return lines


def _stage_lines(status: dict) -> list[str]:
    """The table of stages: progress, attempts, restarts, failures, good checkpoint, eval loss."""
    stage_rows = [
        {
            "stage": s["name"],
            "status": s["status"],
            "steps": f"{s['steps_done']}/{s['steps_total']}",
            "attempts": s["attempts"],
            "in-job restarts": s["restarts"],
            "failures": len(s["failures"]),
            "good checkpoint": s["good_checkpoint"]["step"] if s["good_checkpoint"] else None,
            "eval loss": round(s["eval"]["val_loss"], 4) if s["eval"] else None,
        }
        for s in status["stages"]
    ]
    return _table(stage_rows, list(stage_rows[0]) if stage_rows else ["stage"])


def _goodput_lines(status: dict) -> list[str]:
    """The goodput table, or why the split of the wall time is not known yet."""
    rows = goodput_rows(status)
    if not rows:
        why = (status.get("goodput") or {}).get("missing") or ["no timing recorded yet"]
        return [f"_unknown: {why[0]}_", ""]
    return _table(rows, ["category", *(k for k in rows[0] if k not in ("category", "what")), "what"])


def _image_lines(images: dict[str, str], workdir: str) -> list[str]:
    """The pictures embedded (title → URL), and where else they are."""
    return [
        *(f"![{title}]({url})" for title, url in images.items()),
        "",
        f"_The pictures are also artifacts of the MLflow parent run (`report/`); "
        f"`pretrain report --workdir {workdir}` redraws them with an HTML page._",
        "",
    ]


def _failure_lines(status: dict) -> list[str]:
    """The table of failures of every stage, with where a hung worker was when it had one."""
    failures = [{"stage": s["name"], **f, "where": where_hung(f)} for s in status["stages"] for f in s["failures"]]
    return _table(
        failures,
        (
            "stage",
            "attempt",
            "cause",
            "action",
            "time_lost_s",
            "recovery_s",
            *(("where",) if any(f["where"] for f in failures) else ()),
        ),
    )


def write_report_files(workdir: str | Path, out: str | Path, s3_credentials: dict | None = None) -> dict[str, Path]:
    """The campaign's pictures and an HTML page showing them with the report, into ``out``
    (created). Returns ``{"loss", "goodput", "html"}`` → path."""
    from pretrain.views.plots import write_plots  # matplotlib: only when pictures are asked for

    status = campaign_status(workdir, s3_credentials)
    layout = CampaignLayout(Path(status["workdir"]))
    out = Path(out)
    loss, goodput = write_plots(
        Ledger.read(layout).record,
        layout,
        {"campaign": status["goodput"], "stages": {s["name"]: s["goodput"] for s in status["stages"]}},
        out,
    )
    markdown = campaign_report(workdir, s3_credentials, status)
    page = out / "report.html"
    page.write_text(
        "<!doctype html>\n<html><head><meta charset='utf-8'><title>campaign "
        f"{html.escape(status['campaign'])}</title></head><body>\n"
        f"<img src='{loss.name}' alt='loss vs tokens'><br>\n<img src='{goodput.name}' alt='goodput'>\n"
        f"<pre>{html.escape(markdown)}</pre>\n</body></html>\n"
    )
    return {"loss": loss, "goodput": goodput, "html": page}
