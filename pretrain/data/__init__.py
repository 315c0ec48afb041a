"""The campaign's data: corpora (text, JSONL, Parquet; local or S3), their preparation into packed token shards, the
data set's identity and what it holds."""
