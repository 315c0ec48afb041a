"""What a rank reads: packed token shards, the global sampler, the manifest's schema and the node-local cache of a data
set on S3."""
