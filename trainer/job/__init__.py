"""The contract between the orchestrator and a job: its config (one JSON file), its events and the records a worker
writes."""
