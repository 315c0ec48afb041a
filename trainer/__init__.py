"""Pure-torch trainer: runs inside worker processes and pods. Never imports prefect."""
