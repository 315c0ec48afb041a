"""Reading raw corpora (no torch, no Prefect): the files a data spec names (:mod:`.files`), the
work units they are cut into (:mod:`.units`) and the documents a unit holds (:mod:`.readers`)."""

from pretrain.data.corpus.decoding import SKIP_REASONS, Doc, Skip
from pretrain.data.corpus.files import CorpusError, SourceFile, expand_sources, resolve_format
from pretrain.data.corpus.readers import read_unit, reader_settings
from pretrain.data.corpus.units import WorkUnit, plan_units

__all__ = [
    "SKIP_REASONS",
    "CorpusError",
    "Doc",
    "Skip",
    "SourceFile",
    "WorkUnit",
    "expand_sources",
    "plan_units",
    "read_unit",
    "reader_settings",
    "resolve_format",
]
