"""Where an export may be written: ``check_out`` refuses an output directory whose replacement
would destroy anything but an earlier export. Torch-free, so ``pretrain export`` refuses a wrong
OUT at once, before it reads the checkpoint."""

from __future__ import annotations

from pathlib import Path

PROVENANCE = "pretrain.json"  # what every export holds (where it came from): what --overwrite may replace


class ExportRefused(FileExistsError):
    """``out`` is not a place an export may be written to (or replace): it holds a campaign, the
    checkpoint, or files that are not an earlier export."""


def _is_within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def check_out(out: Path, checkpoint: str, overwrite: bool) -> None:
    """Refuse an ``out`` whose replacement would destroy something other than an earlier export:
    the checkpoint (or a directory holding it), a campaign workdir (``ledger.json``) or a parent
    of one, or any directory without ``pretrain.json``. An empty directory may be replaced."""
    real = out.resolve()
    if "://" not in checkpoint or checkpoint.startswith("file://"):
        ckpt = Path(checkpoint.removeprefix("file://")).expanduser().resolve()
        if real == ckpt:
            raise ExportRefused(f"{out} is the checkpoint being exported: export to a directory outside it")
        if _is_within(real, ckpt):
            raise ExportRefused(f"{out} is inside the checkpoint {ckpt}: export to a directory outside it")
        if _is_within(ckpt, real):
            raise ExportRefused(f"{out} holds the checkpoint {ckpt} being exported: choose another directory")
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise ExportRefused(f"{out} already exists: choose another directory or pass --overwrite (overwrite=True)")
    if not out.is_dir() or out.is_symlink():
        raise ExportRefused(f"{out} is not a directory: remove it yourself or choose another directory")
    if next(out.iterdir(), None) is None:
        return
    if not (out / PROVENANCE).is_file():
        raise ExportRefused(
            f"{out} is not an earlier export (it has no {PROVENANCE}): --overwrite only replaces an "
            "earlier export; choose another directory, or empty this one yourself"
        )
    ledger = next(out.rglob("ledger.json"), None)
    if ledger is not None:
        raise ExportRefused(
            f"{out} holds a campaign ({ledger} is its ledger.json): --overwrite would delete it; "
            "choose another directory"
        )
