"""MLflow: a campaign's runs (one parent, one nested run per stage), its tracking store, the metrics forwarder, the
data set as a run input, a health probe."""
