"""Data preparation at scale: sources (pretrain.corpus) → tokenizer → token shards in a versioned,
immutable data set (``<root>/<fingerprint>/``) with its manifest written last."""
