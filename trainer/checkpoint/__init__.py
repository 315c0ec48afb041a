"""Checkpoints: the atomic commit protocol and everything that writes or reads through it.

- ``store``: ``CheckpointStore``: shards, node records, manifest, the ``latest`` pointer (last).
- ``records``: the JSON records of a checkpoint location (manifest, node record, verdict, pointer).
- ``state``: a worker saves / restores its training state through the store.
- ``sharded``: FSDP2 pieces: save each rank's piece, reassemble or re-shard on load.
- ``fence``: only the newest job of a stage commits.
- Flash checkpoints (in-memory snapshots persisted by a separate process): ``flat`` (pickle-free
  tensor layout), ``shm`` (shared-memory slots), ``shmdirs`` (the node's snapshot directory),
  ``flash`` (worker side: copy into a slot), ``saver`` (the node's saver: persist and commit).
"""
