"""Helpers every part of the trainer shares: atomic writes, backoff, process lifetimes, a full disk."""
