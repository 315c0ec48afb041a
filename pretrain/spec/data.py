"""The data section of a campaign spec: where the corpus comes from (text, JSONL, Parquet; local
or S3), the tokenizer, and how data preparation shards and checks it."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pretrain.spec.base import Section
from pretrain.spec.uris import S3_CREDENTIALS_GO, no_credentials_in_url


class TokenizerSpec(Section):
    vocab_size: int = Field(
        2048,
        ge=260,
        le=4_294_967_295,
        description="BPE vocabulary size when the tokenizer is trained (byte-level; at least 256 bytes + specials). "
        "Shards are uint16 when the vocabulary fits, uint32 otherwise.",
    )
    min_frequency: int = Field(2, ge=1, description="Minimum pair frequency for a BPE merge.")
    sample_bytes: int = Field(
        50_000_000,
        gt=0,
        description="A trained tokenizer learns from a deterministic sample of at most this many bytes "
        "of the train documents (taken evenly across sources), so training it is bounded whatever the corpus size.",
    )
    path: str | None = Field(
        None,
        description="Use this existing Hugging Face `tokenizer.json` (a local path or s3:// URL) instead of training "
        "one; `vocab_size`/`min_frequency`/`sample_bytes` are then unused. It must define the document separator "
        "`<|endoftext|>` (or `eos_token` names another).",
    )
    eos_token: str = Field("<|endoftext|>", min_length=1, description="Special token placed between documents.")

    @field_validator("path")
    @classmethod
    def _no_credentials(cls, url: str | None) -> str | None:
        return no_credentials_in_url(url, S3_CREDENTIALS_GO)


SOURCE_FORMATS = ("auto", "text", "jsonl", "parquet")


class SourceSpec(Section):
    path: str = Field(
        ...,
        min_length=1,
        description="A file, a glob ('**' recurses) or an S3 prefix/glob "
        "('s3://bucket/corpus/**.jsonl'); '{stdlib}' expands to the Python standard library directory.",
    )
    format: Literal["auto", "text", "jsonl", "parquet"] = Field(
        "auto",
        description="'auto' follows the extension: .jsonl/.ndjson/.json (also .gz/.zst) → jsonl, .parquet → "
        "parquet, anything else → text (one document per file).",
    )
    text_field: str = Field(
        "text", min_length=1, description="JSONL field / Parquet column holding each document's text."
    )
    weight: float = Field(
        1.0,
        gt=0,
        description="How often this source's documents appear in the train split: 2.0 twice, 0.5 a "
        "deterministic half. Validation documents are never repeated.",
    )

    @field_validator("path")
    @classmethod
    def _no_credentials(cls, url: str) -> str:
        return no_credentials_in_url(url, S3_CREDENTIALS_GO)


Source = str | SourceSpec


class DataSpec(Section):
    sources: list[Source] | dict[str, list[Source]] = Field(
        default_factory=lambda: ["{stdlib}/json/*.py"],
        description="What to train on. Each entry is a path/glob/S3 URL string (the format follows the extension) or "
        "a mapping {path, format, text_field, weight} (see SourceSpec): text files (one document per file), JSONL "
        "(one JSON document per line, .gz/.zst read transparently) or Parquet. '{stdlib}' expands to the Python "
        "standard library directory, so the demo needs nothing from outside; '**' recurses. A mapping of group name "
        "→ sources makes named data groups that stages can mix in chosen proportions (`stages[].mixture`); a plain "
        "list is one group named 'all'.",
    )
    max_bytes: int | None = Field(
        None,
        gt=0,
        description="Read at most this many bytes of source files per group (whole files, in order; keeps "
        "demos small). Empty: the whole corpus.",
    )
    tokenizer: TokenizerSpec = Field(
        default_factory=TokenizerSpec, description="Tokenizer: trained here or loaded from a file."
    )
    val_fraction: float = Field(
        0.05,
        gt=0.0,
        lt=0.5,
        description="Fraction of documents held out for validation/evaluation (chosen by a hash of each document).",
    )
    shard_tokens: int = Field(1_000_000, gt=0, description="Tokens per packed shard file.")
    workers: int = Field(
        0,
        ge=0,
        description="Processes that read and tokenize the corpus; 0: one per CPU core. The output does not depend on "
        "it.",
    )
    unit_bytes: int = Field(
        32 * 1024 * 1024,
        ge=4096,
        description="Size of one work unit (a byte range of a text/JSONL file; Parquet files "
        "split by row groups of about this size). Memory is bounded by workers × unit_bytes, whatever the corpus size.",
    )
    decode_errors: Literal["replace", "skip", "error"] = Field(
        "replace",
        description="Isolated invalid UTF-8 bytes in a text document: 'replace' with U+FFFD, 'skip' the "
        "document (counted), or 'error' (stop, naming the file).",
    )
    binary_threshold: float = Field(
        0.01,
        ge=0.0,
        le=1.0,
        description="A file with a NUL byte, or more than this share of invalid UTF-8 bytes, is "
        "binary: skipped and counted, never trained on.",
    )
    on_bad_record: Literal["error", "skip"] = Field(
        "error",
        description="A JSONL line that is not a JSON object, or a record without `text_field` (or whose value "
        "is not a string): 'error' stops with file and line; 'skip' counts and reports it.",
    )
    uri: str | None = Field(
        None,
        description="Where prepared data sets live, each in its own <fingerprint>/ directory: empty → "
        "<workdir>/data; or 's3://bucket/prefix' (nodes then fetch the shards they need into a local cache).",
    )
    s3_endpoint_url: str | None = Field(
        None,
        description="S3-compatible endpoint for s3:// sources, tokenizer and data sets; empty → "
        "checkpoint.s3_endpoint_url.",
    )
    s3_region: str | None = Field(None, description="S3 region for the same; empty → checkpoint.s3_region.")

    @field_validator("uri", "s3_endpoint_url")
    @classmethod
    def _no_credentials(cls, url: str | None) -> str | None:
        return no_credentials_in_url(url, S3_CREDENTIALS_GO)

    @model_validator(mode="after")
    def _groups_named(self) -> DataSpec:
        groups = self.groups()
        if not groups or not all(groups.values()):
            raise ValueError("sources must name at least one file pattern (in every group)")
        bad = [g for g in groups if not re.fullmatch(r"[A-Za-z0-9_-]+", g)]
        if bad:
            raise ValueError(f"data group names may use letters, digits, '-', '_' only: {bad}")
        return self

    def groups(self) -> dict[str, list[SourceSpec]]:
        """Named groups of sources ('all' for a plain list), each entry as a :class:`SourceSpec`."""
        raw = dict(self.sources) if isinstance(self.sources, dict) else {"all": list(self.sources)}
        return {g: [SourceSpec(path=s) if isinstance(s, str) else s for s in entries] for g, entries in raw.items()}
