"""Kubernetes: what the backend creates for a stage (pure manifests; no API calls here)."""
