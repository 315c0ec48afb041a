"""What people read of a campaign, computed from its workdir or MLflow and never written back: status, following a run,
training progress, recovery notes, goodput, reports, plots and comparisons."""
