"""Prefect tasks: the thin, testable units the flows call."""
