"""Data preparation at scale: sources (pretrain.data.corpus) → tokenizer → token shards in a versioned,
immutable data set (``<root>/<fingerprint>/``) with its manifest written last.

The entry point is :func:`pretrain.data.prepare.pipeline.prepare`; this package imports nothing itself
(pool workers import its modules and should not pay for the whole pipeline)."""
