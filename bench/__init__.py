"""Benchmarks: each ``bench/<name>.py`` runs alone; ``python -m bench`` runs them all and
rewrites docs/benchmarks.md."""
