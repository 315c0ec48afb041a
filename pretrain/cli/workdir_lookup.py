"""Which campaign a command means when no ``--workdir`` is given: the one ``pretrain run`` made
here, in the specs' default workdir ``./runs/{name}`` (or the current directory, if it is one).

    pretrain run           # ./runs/tiny
    pretrain status        # finds ./runs/tiny; with several campaigns here it lists them
    pretrain data inspect  # its data set
"""

from __future__ import annotations

from pathlib import Path

from pretrain.spec.layout import CampaignLayout
from pretrain.views.status import NoCampaign

RUNS = "runs"  # the specs' default workdir is ./runs/{name}
WORKDIR = "--workdir DIR (the campaign's workdir)"  # what to pass instead, by default


def is_campaign_workdir(location: str) -> bool:
    """Whether ``location`` (a path, or where a checkpoint is asked for: a URL) is a campaign's workdir."""
    return "://" not in location and CampaignLayout(Path(location)).ledger.is_file()


def campaigns_here(here: Path) -> list[Path]:
    """The campaign workdirs (a ledger inside) at ``here`` and under ``here/runs``."""
    candidates = [here]
    try:
        candidates += sorted(p for p in (here / RUNS).iterdir() if p.is_dir())
    except OSError:  # no ./runs, or not readable
        pass
    return [p for p in candidates if is_campaign_workdir(str(p))]


def pick_workdir(given: Path | None, here: Path | None = None, instead: str = WORKDIR) -> Path:
    """``given``, else the one campaign here; ``NoCampaign`` says what to pass ``instead`` when
    there is none or more than one."""
    if given is not None:
        return given
    here = Path.cwd() if here is None else here
    found = campaigns_here(here)
    if len(found) == 1:
        return found[0]
    if not found:
        raise NoCampaign(f"no campaign in {here} or {here / RUNS}/*: pass {instead}")
    names = ", ".join(str(p.relative_to(here)) if p != here else "." for p in found)
    raise NoCampaign(f"{len(found)} campaigns here ({names}): pass {instead}")


def _campaign(workdir: Path | None, here: Path | None, instead: str):
    """(workdir as the ledger records it, its layout, its ledger) of the campaign a command means;
    ``NoCampaign`` saying to give ``instead`` when there is none, ``LedgerError`` if its ledger is
    damaged (the caller reports it)."""
    from pretrain.state.ledger import Ledger

    workdir = pick_workdir(workdir, here, instead=instead).expanduser().resolve()
    layout = CampaignLayout(workdir)
    ledger = Ledger.read(layout)
    if ledger is None:
        raise NoCampaign(f"{workdir} holds no campaign (no ledger.json): give a campaign's workdir or {instead}")
    return workdir, layout, ledger


def good_checkpoint(workdir: Path | None = None, here: Path | None = None) -> str:
    """Where the campaign ended up: the newest good checkpoint of its last stage that has one
    (``pretrain eval`` / ``export`` given a workdir, or none and run where ``pretrain run`` ran),
    in the workdir's own ``checkpoints/`` when the campaign was moved or copied. ``NoCampaign``
    if there is none to take."""
    from pretrain.state.locations import recorded_checkpoints

    instead = "a checkpoint (<stage location>/step_XXXXXXXX)"
    workdir, layout, ledger = _campaign(workdir, here, instead)
    stages = [(n, s) for n, s in ledger.record.stages.items() if s.good_checkpoint]
    if not stages:
        raise NoCampaign(f"the campaign in {workdir} has no good checkpoint yet: pass {instead}")
    name, stage = stages[-1]
    where, moved = recorded_checkpoints(layout, name, stage.checkpoints)
    return str(Path(where) / Path(stage.good_checkpoint.path).name) if moved else stage.good_checkpoint.path


def campaign_data_set(workdir: Path | None = None, here: Path | None = None) -> str:
    """The data set the campaign trains on (``pretrain data inspect`` given a workdir, or none and
    run where ``pretrain run`` ran): the location its ledger records, or the same data set in the
    workdir's own ``data/`` when the campaign was moved or copied. ``NoCampaign`` if it has none yet."""
    instead = "a data set (its directory with manifest.json, or s3:// URL)"
    workdir, layout, ledger = _campaign(workdir, here, instead)
    data = ledger.record.data
    if data is None or not (data.location or data.fingerprint):
        raise NoCampaign(f"the campaign in {workdir} has no data set yet: `pretrain data prepare` makes it")
    recorded = data.location or str(layout.data_dir)  # none: the release before's flat <workdir>/data
    own = layout.data_dir / data.fingerprint if data.location and data.fingerprint else layout.data_dir
    return str(own) if "://" not in recorded and own.is_dir() else recorded  # own: also moved or copied here
