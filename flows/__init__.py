"""Prefect flows: one file per stage flow, plus the campaign flow that chains them."""
