"""The campaign's pictures (PNG, matplotlib's Agg backend: no display needed), read from the
workdir only: loss vs tokens (train and eval, stages shaded, markers at restarts and rollbacks)
and where the wall time went (the goodput split, one bar per stage and the campaign)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: never a display
import matplotlib.pyplot as plt  # noqa: E402

from pretrain.spec.layout import CampaignLayout  # noqa: E402
from pretrain.state.schema import CampaignRecord  # noqa: E402
from pretrain.views.goodput import ALL, read_jobs  # noqa: E402
from trainer.job.config import JobConfig
from trainer.job.events import IN_PROCESS_SOURCES, EventKind  # noqa: E402
from trainer.job.layout import JobLayout

LOSS_PNG, GOODPUT_PNG = "loss_vs_tokens.png", "goodput.png"
COLORS = {
    "productive": "#2ca02c",
    "recomputation": "#d62728",
    "checkpoint_blocking": "#ff7f0e",
    "detection": "#9467bd",
    "recovery": "#8c564b",
    "node_checks": "#e377c2",
    "validation_eval": "#17becf",
    "registration": "#aec7e8",
    "data_preparation": "#bcbd22",
    "provisioning": "#1f77b4",
    "idle": "#c7c7c7",
}


@dataclass
class StageCurve:
    """One stage's loss curve, by tokens since the campaign's start."""

    name: str
    start_tokens: float
    end_tokens: float = 0.0
    train: dict[int, tuple[float, float]] = field(
        default_factory=dict
    )  # step → (tokens, loss); a redone step's last run
    evals: list[tuple[float, float]] = field(default_factory=list)  # (tokens, val loss)
    restarts: list[float] = field(default_factory=list)  # tokens where workers restarted (in-job or a relaunch)
    rollbacks: list[float] = field(default_factory=list)  # tokens of a skipped (rolled back) step


def _seq_len(job_dir: Path) -> int | None:
    try:
        seq = JobConfig.load(JobLayout(job_dir).config).stage.seq_len  # of this release's form or the one before
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return seq if isinstance(seq, int) and seq > 0 else None


def loss_curves(record: CampaignRecord, layout: CampaignLayout) -> list[StageCurve]:
    """Every stage's train loss (metrics.jsonl of every attempt), eval loss and restart points."""
    curves, offset = [], 0.0
    for name, stage in record.stages.items():
        curve = StageCurve(name, offset)
        tokens_at: dict[int, float] = {}  # step → tokens consumed by then (the job that logged it last)
        marks: list[tuple[list, int]] = []
        for job in read_jobs(layout, name):
            seq = _seq_len(layout.job_dir(name, job.attempt)) or 1
            for m in job.metrics:
                consumed = m.get("consumed")
                tokens_at[m["step"]] = consumed * seq if isinstance(consumed, (int, float)) else m["step"]
                if isinstance(m.get("loss"), (int, float)):
                    curve.train[m["step"]] = (offset + tokens_at[m["step"]], float(m["loss"]))
            for e in job.events:
                if e.get("event") == EventKind.START and e.get("rank") == 0 and e.get("source") in IN_PROCESS_SOURCES:
                    marks.append((curve.restarts, e["step"]))
                elif e.get("event") == EventKind.ANOMALY and isinstance(e.get("step"), int):
                    marks.append((curve.rollbacks, e["step"]))
        rates = sorted(t / s for s, t in tokens_at.items() if s > 0)
        rate = rates[len(rates) // 2] if rates else 1.0  # tokens per step (median), for steps not logged

        def at(step: int, offset: float = offset, tokens_at: dict[int, float] = tokens_at, rate: float = rate) -> float:
            return offset + tokens_at.get(step, step * rate)

        for where, step in marks:
            where.append(at(step))
        if (
            stage.eval
            and isinstance(stage.eval.get("val_loss"), (int, float))
            and isinstance(stage.eval.get("step"), int)
        ):
            curve.evals.append((at(stage.eval["step"]), float(stage.eval["val_loss"])))
        curve.end_tokens = max(at(stage.steps), max((t for t, _ in curve.train.values()), default=offset))
        offset = curve.end_tokens
        curves.append(curve)
    return curves


def plot_loss(curves: list[StageCurve], path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100)
    try:
        for i, c in enumerate(curves):
            ax.axvspan(c.start_tokens, c.end_tokens, color="#000000", alpha=0.04 if i % 2 else 0.09, lw=0)
            ax.text(c.start_tokens, 1.0, f" {c.name}", transform=ax.get_xaxis_transform(), va="top", fontsize=8)
        train = sorted(p for c in curves for p in c.train.values())
        if train:
            ax.plot(*zip(*train), lw=1.2, label="train loss", color="#1f77b4")
        evals = [p for c in curves for p in c.evals]
        if evals:
            ax.plot(*zip(*evals), "o", color="#d62728", label="eval loss")
        for label, xs, style in (
            ("restart", [x for c in curves for x in c.restarts], dict(color="#8c564b", ls="--")),
            ("rollback", [x for c in curves for x in c.rollbacks], dict(color="#9467bd", ls=":")),
        ):
            for j, x in enumerate(xs):
                ax.axvline(x, lw=1, label=label if j == 0 else None, **style)
        ax.set_xlabel("tokens")
        ax.set_ylabel("loss")
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path


def plot_goodput(goodput: dict, path: Path, title: str) -> Path:
    """One horizontal stacked bar per stage and the campaign: seconds by category."""
    rows = [(name, g) for name, g in [*goodput["stages"].items(), ("campaign", goodput["campaign"])] if g.get("known")]
    fig, ax = plt.subplots(figsize=(9, 2.2 + 0.5 * max(len(rows), 1)), dpi=100)
    try:
        for i, (_name, g) in enumerate(rows):
            left = 0.0
            for cat in ALL:
                width = g["parts_s"].get(cat, 0.0)
                ax.barh(i, width, left=left, color=COLORS[cat], label=cat.replace("_", " ") if i == 0 else None)
                left += width
            ax.text(left, i, f" {100 * (g['goodput'] or 0):.1f}%", va="center", fontsize=8)
        ax.set_yticks(range(len(rows)), [name for name, _ in rows])
        ax.set_xlabel("seconds of wall time")
        ax.set_title(title if rows else f"{title}: unknown (no timing recorded)")
        if rows:
            ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7, frameon=False)
        fig.tight_layout()
        fig.savefig(path, format="png", bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def write_plots(record: CampaignRecord, layout: CampaignLayout, goodput: dict, out: Path) -> list[Path]:
    """Both PNGs into ``out`` (created); returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    return [
        plot_loss(loss_curves(record, layout), out / LOSS_PNG, f"campaign {record.campaign}: loss vs tokens"),
        plot_goodput(goodput, out / GOODPUT_PNG, f"campaign {record.campaign}: goodput"),
    ]
