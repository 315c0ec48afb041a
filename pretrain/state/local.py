"""The campaign ledger as a file in the workdir: reading it (a damaged, foreign or newer file is
reported naming it and how to recover), its previous generation ``ledger.json.prev`` and
``pretrain recover-ledger``. Writing it is :class:`pretrain.state.ledger.Ledger`'s."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from pydantic import ValidationError

from pretrain.spec.layout import CampaignLayout, a_file_in_the_way
from pretrain.state.schema import LEDGER_VERSION, CampaignRecord, describe_problem
from trainer.common.atomic import atomic_write_bytes


class LedgerError(RuntimeError):
    """The ledger cannot be used or recovered as asked; the message says what to do."""


class LedgerDamaged(LedgerError):
    """``ledger.json`` cannot be read; the message names it and how to recover."""


class LedgerNewer(LedgerError):
    """``ledger.json`` was written by a newer release, in a version of the file this one does not know."""


def _parse(path: Path | str, data: bytes) -> CampaignRecord:
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, ValueError) as err:
        raise LedgerDamaged(f"{path} is damaged (not valid JSON: {err})") from None
    if not isinstance(obj, dict):
        raise LedgerDamaged(f"{path} is damaged (a JSON {type(obj).__name__}, not a JSON object)")
    version = obj.get("version", 1)
    if isinstance(version, int) and not isinstance(version, bool) and version > LEDGER_VERSION:
        raise LedgerNewer(
            f"{path} was written by a newer prefect-pretrain (ledger version {version}; this release "
            f"reads up to {LEDGER_VERSION}): run the campaign with that release, or upgrade this one"
        )
    try:
        return CampaignRecord.model_validate(obj)
    except ValidationError as err:
        problems = "; ".join(describe_problem(e) for e in err.errors()[:3])
        raise LedgerDamaged(f"{path} is damaged ({problems})") from None


def _prev(path: Path) -> Path:
    return path.with_name(path.name + ".prev")


def _read(path: Path) -> CampaignRecord | None:
    """The ledger at ``path``; None if there is none; LedgerDamaged saying how to recover."""
    read = _read_with_bytes(path)
    return None if read is None else read[1]


def _read_with_bytes(path: Path) -> tuple[bytes, CampaignRecord] | None:
    """The ledger's bytes and what they say (the bytes become ``.prev`` on the next write)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise LedgerDamaged(f"{path} is damaged (a directory, not a file). {_recovery(path)}") from None
    except NotADirectoryError:
        raise LedgerError(f"{a_file_in_the_way(path.parent)}: give the campaign's workdir") from None
    except OSError as err:
        raise LedgerError(f"cannot read {path}: {err.strerror or err}") from None
    try:
        return data, _parse(path, data)
    except LedgerDamaged as err:
        raise LedgerDamaged(f"{err}. {_recovery(path)}") from None


def _recovery(path: Path) -> str:
    """How to get a usable ledger back, depending on its previous generation."""
    prev = _prev(path)
    try:
        saved = _parse(prev, prev.read_bytes())
    except (OSError, LedgerError) as err:
        why = "it does not exist" if isinstance(err, FileNotFoundError) else str(err)
        return (
            f"There is no intact previous generation ({prev}: {why}). Move the damaged file aside "
            f"(mv {path} {path}.damaged) and run the campaign again with its spec: training resumes from "
            "its checkpoints; the ledger's history (attempts, failures, verdicts) starts anew"
        )
    return (
        f"The previous generation {prev} is intact (campaign {saved.campaign!r}, status {saved.status.value!r}): "
        f"restore it with `pretrain recover-ledger --workdir {path.parent}` (the damaged file is kept as "
        f"{path.name}.damaged-<time>), then run the same command again"
    )


def recover_ledger(workdir: str | Path) -> Path:
    """Replace a damaged ``ledger.json`` with its intact previous generation; the damaged file is
    moved aside (``ledger.json.damaged-<time>``), never deleted. Returns where it went. Raises
    :class:`LedgerError` when there is nothing to recover, :class:`LedgerDamaged` when the
    previous generation is not intact either. Hold the campaign lock while calling it."""
    path = CampaignLayout(Path(workdir).expanduser().resolve()).ledger
    try:
        intact = _read(path) is not None
    except LedgerDamaged:
        intact = None
    if intact is not None:
        raise LedgerError(
            f"{path} is intact: nothing to recover"
            if intact
            else f"{path} does not exist: no campaign to recover in {path.parent}"
        )
    prev = _prev(path)
    try:
        data = prev.read_bytes()
        _parse(prev, data)
    except (OSError, LedgerDamaged):
        raise LedgerDamaged(f"{path} is damaged. {_recovery(path)}") from None
    aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
    os.replace(path, aside)
    atomic_write_bytes(path, data)
    return aside
