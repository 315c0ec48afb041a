"""A campaign's own state: the ledger (its schema, its file and shared-storage forms), the workdir layout, where
checkpoints and data live, and the lock, lease and guard that keep one run at a time."""
