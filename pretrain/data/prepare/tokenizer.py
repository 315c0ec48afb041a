"""The data set's tokenizer: a byte-level BPE trained on a bounded, deterministic sample of the
train documents, or an existing Hugging Face ``tokenizer.json`` (local or S3)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pretrain.data.prepare.errors import DataPrepError
from pretrain.spec.data import TokenizerSpec

EOT = "<|endoftext|>"
UINT16_VOCAB = 1 << 16


@dataclass(frozen=True)
class LoadedTokenizer:
    """A tokenizer as the pipeline ships it: its JSON (what workers load and the data set
    stores), its sha256, the document separator's id and the shard dtype it needs."""

    json: str
    sha256: str
    eot_id: int
    vocab_size: int

    @property
    def dtype(self) -> str:
        return "uint16" if self.vocab_size <= UINT16_VOCAB else "uint32"

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_str(self.json)


def _loaded(text: str, eos_token: str, where: str) -> LoadedTokenizer:
    try:
        tok = Tokenizer.from_str(text)
    except Exception as err:  # the tokenizers library raises plain Exception subclasses
        raise DataPrepError(
            f"{where} is not a Hugging Face tokenizer.json ({err}): point tokenizer.path "
            "at a tokenizer.json file, or leave it empty to train one"
        ) from None
    eot_id = tok.token_to_id(eos_token)
    if eot_id is None:
        raise DataPrepError(
            f"{where} has no token {eos_token!r} to separate documents: set tokenizer.eos_token "
            "to one of its special tokens (e.g. '</s>')"
        )
    return LoadedTokenizer(text, hashlib.sha256(text.encode()).hexdigest(), eot_id, tok.get_vocab_size())


def load_tokenizer(spec: TokenizerSpec, s3_options: dict | None = None) -> LoadedTokenizer:
    """The tokenizer at ``spec.path`` (local or ``s3://``); a clear error if it is missing or foreign."""
    from trainer.storage import StorageError, open_storage

    path = str(spec.path)
    try:
        if path.startswith("s3://"):
            parent, _, name = path.rstrip("/").rpartition("/")
            raw = open_storage(parent, **(s3_options or {})).get_bytes(name)
        else:
            raw = Path(path).expanduser().read_bytes()
        text = raw.decode("utf-8")
    except (OSError, StorageError, UnicodeDecodeError, ValueError) as err:
        raise DataPrepError(
            f"tokenizer.path {path!r} cannot be read ({err}): fix the path or leave it empty to train a tokenizer"
        ) from None
    return _loaded(text, spec.eos_token, f"tokenizer.path {path!r}")


def train_tokenizer(sample: Iterable[str], spec: TokenizerSpec) -> LoadedTokenizer:
    """A byte-level BPE learned from ``sample`` (deterministic for the same sample and settings)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=spec.min_frequency,
        special_tokens=[spec.eos_token],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(sample, trainer=trainer)
    return _loaded(tok.to_str(), spec.eos_token, "the trained tokenizer")


def tokenizer_from_json(text: str, eos_token: str, where: str) -> LoadedTokenizer:
    """A tokenizer cached earlier (the caller treats a damaged one as absent)."""
    return _loaded(text, eos_token, where)
