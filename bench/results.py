"""What a benchmark script hands to the runner (``python -m bench``) besides its printed table.

A script prints its table on stdout as it always did (so it keeps working alone) and, when the
runner set ``BENCH_RESULT`` in its environment, also writes there a JSON record: the ratios it
measured against their targets (each met or missed, with why), or why it was skipped. Alone,
:func:`report` prints the checks under the table instead.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

RESULT_ENV = "BENCH_RESULT"


@dataclass
class Check:
    """One measured figure against its target: ``value`` ``op`` ``target`` (op ``>=`` or ``<=``)."""

    what: str  # e.g. "our loop / plain PyTorch loop, tokens/s"
    value: float
    target: float
    op: str = ">="
    why: str = ""  # when missed: what this machine or this code is short of (a reason, not a shrug)

    @property
    def met(self) -> bool:
        return self.value >= self.target if self.op == ">=" else self.value <= self.target

    def line(self) -> str:
        verdict = "met" if self.met else f"missed: {self.why or 'no reason recorded'}"
        return f"{self.what}: {self.value:.3g} (target {self.op} {self.target:g}) — {verdict}"


def report(checks: list[Check] | None = None, skipped: str | None = None, **facts) -> None:
    """Hand the checks (or the reason the benchmark did not run) to the runner, or print them
    when run alone. ``facts``: small JSON values worth keeping (sizes, settings)."""
    record = {"checks": [asdict(c) | {"met": c.met} for c in checks or []], "skipped": skipped, "facts": facts}
    target = os.environ.get(RESULT_ENV)
    if target:
        from trainer.common.atomic import atomic_write_json

        atomic_write_json(target, record)
        return
    if skipped:
        print(f"skipped: {skipped}")
    for c in checks or []:
        print(c.line())


def load_result(path: Path) -> dict:
    """The record a script wrote; an absent or unreadable one is an empty record (the runner
    reports the script's exit status and output instead)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"checks": [], "skipped": None, "facts": {}, "unreadable": True}
    if not isinstance(record, dict):
        return {"checks": [], "skipped": None, "facts": {}, "unreadable": True}
    checks = [
        Check(**{k: c[k] for k in ("what", "value", "target", "op", "why") if k in c})
        for c in record.get("checks") or []
        if isinstance(c, dict) and {"what", "value", "target"} <= c.keys()
    ]
    return {"checks": checks, "skipped": record.get("skipped"), "facts": record.get("facts") or {}}
