"""How a comparison of campaigns is shown: one table (rows: what is compared, columns: campaigns)
for the terminal and the Prefect artifact, JSON, and a PNG of eval loss against tokens seen."""

from __future__ import annotations

from pathlib import Path

from pretrain.views.compare import MISSING, CampaignSummary

IDENTITY_PARAMS = {"name", "workdir"}  # differ between any two campaigns: the header says them


def _num(x: float | None, fmt: str) -> str:
    return MISSING if x is None else format(x, fmt)


def _duration(s: float | None) -> str:
    if s is None:
        return MISSING
    h, rest = divmod(int(round(s)), 3600)
    return f"{h}h {rest // 60:02d}m" if h else f"{rest // 60}m {rest % 60:02d}s"


ROWS = (  # label, how one summary's cell is written
    ("run id", lambda c: c.run_id),
    ("status", lambda c: c.status),
    ("tokens seen", lambda c: _num(c.tokens_seen, ",.0f")),
    ("final eval loss", lambda c: _num(c.final_eval_loss, ".4f")),
    ("best eval loss", lambda c: _num(c.best_eval_loss, ".4f")),
    ("goodput", lambda c: MISSING if c.goodput is None else f"{c.goodput:.1%}"),
    ("wall time", lambda c: _duration(c.wall_time_s)),
    ("restarts", lambda c: _num(c.restarts, "d")),
    ("rollbacks", lambda c: _num(c.rollbacks, "d")),
    (
        "checkpoint blocking",
        lambda c: _num(c.checkpoint_stall_s, ".1f") + ("" if c.checkpoint_stall_s is None else " s"),
    ),
)


def differing_params(summaries: list[CampaignSummary]) -> list[str]:
    """The parameter keys whose value is not the same in all campaigns (missing counts as a value)."""
    keys = sorted({k for c in summaries for k in c.params} - IDENTITY_PARAMS)
    return [k for k in keys if len({c.params.get(k) for c in summaries}) > 1]


def table(summaries: list[CampaignSummary]) -> tuple[list[str], list[list[str]]]:
    """Header (``""`` then each campaign) and rows: the numbers, then each differing parameter."""
    header = [""] + [c.campaign if c.campaign == c.label else f"{c.campaign} ({c.label})" for c in summaries]
    rows = [[label] + [cell(c) for c in summaries] for label, cell in ROWS]
    rows += [[f"param {k}"] + [c.params.get(k, MISSING) for c in summaries] for k in differing_params(summaries)]
    return header, rows


def markdown(summaries: list[CampaignSummary]) -> str:
    """The table as Markdown (the ``compare-campaigns`` flow's artifact)."""
    header, rows = table(summaries)
    esc = [[cell.replace("|", "\\|") for cell in row] for row in [header, *rows]]
    lines = ["| " + " | ".join(esc[0]) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in esc[1:]]
    return "\n".join(lines) + "\n"


def plot_eval_loss(summaries: list[CampaignSummary], path: Path) -> Path:
    """Eval loss against tokens seen, one line per campaign, as a PNG at ``path`` (written to a
    temporary name first, then renamed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--png needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    try:
        for c in summaries:
            if c.eval_curve:
                xs, ys = zip(*c.eval_curve)
                ax.plot(xs, ys, marker="o", label=c.campaign)
        ax.set_xlabel("tokens seen")
        ax.set_ylabel("eval loss (val_loss)")
        ax.set_title("eval loss vs tokens")
        ax.grid(alpha=0.3)
        if any(c.eval_curve for c in summaries):
            ax.legend()
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        fig.savefig(tmp, format="png")
        tmp.replace(path)
    finally:
        plt.close(fig)
    return path
