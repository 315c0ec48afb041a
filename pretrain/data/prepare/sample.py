"""Training the tokenizer on a bounded, deterministic sample of the train documents: an equal
byte budget per work unit (so every source is represented), read in unit order, only documents
whose hash puts them in train. The result is cached per fingerprint, so a resumed run does not
train it again."""

from __future__ import annotations

from pathlib import Path

from pretrain.data.prepare.assemble import TWO64
from pretrain.data.prepare.errors import DataPrepError
from pretrain.data.prepare.tokenizer import LoadedTokenizer, tokenizer_from_json, train_tokenizer
from pretrain.data.prepare.unitcache import doc_hash
from pretrain.spec.data import DataSpec
from trainer.common.atomic import atomic_write_bytes


def sample_texts(data: DataSpec, units: list, s3_options: dict | None) -> list[str]:
    """At most ``tokenizer.sample_bytes`` bytes of train documents, evenly across ``units``."""
    from pretrain.data.corpus.readers import Doc, read_unit

    budget = max(1, data.tokenizer.sample_bytes // max(1, len(units)))
    threshold = int(data.val_fraction * TWO64)
    texts: list[str] = []
    for unit in units:
        left = budget
        for item in read_unit(unit, data, s3_options):
            if not isinstance(item, Doc) or not item.text or doc_hash(item.text) < threshold:
                continue
            raw = item.text.encode("utf-8", "surrogatepass")
            texts.append(item.text if len(raw) <= left else raw[:left].decode("utf-8", "ignore"))
            left -= min(left, len(raw))
            if left <= 0:
                break
    return texts


def trained_tokenizer(data: DataSpec, units: list, cache: Path, s3_options: dict | None, log) -> LoadedTokenizer:
    """The tokenizer trained for this fingerprint: from ``cache`` if a run made it already."""
    if cache.is_file():
        try:
            return tokenizer_from_json(cache.read_text(), data.tokenizer.eos_token, str(cache))
        except (OSError, UnicodeDecodeError, DataPrepError):
            log(f"{cache} is damaged; training the tokenizer again")
    texts = sample_texts(data, units, s3_options)
    log(
        f"training a {data.tokenizer.vocab_size}-token BPE tokenizer on a {sum(map(len, texts)) / 1024:,.0f} KiB "
        f"sample of {len(units)} work unit(s)"
    )
    tok = train_tokenizer(texts, data.tokenizer)
    atomic_write_bytes(cache, tok.json.encode())
    return tok
