"""A fork server with torch imported, so processes start without paying ``import torch`` (``python -m
trainer.zygote``)."""
