"""Data preparation at scale: sources (pretrain.corpus) → tokenizer → token shards in a versioned,
immutable data set (``<root>/<fingerprint>/``) with its manifest written last.

``prepare`` is imported from :mod:`pretrain.dataset.prepare` (this package stays light to import:
pool workers import its modules too)."""
