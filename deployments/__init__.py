"""Ways to deploy the flows: ``prefect.yaml`` (work pool + worker) or ``python -m deployments.serve``."""
