"""The ``pretrain`` command line: one module per command group, each error one line a user can act on. The only wing
that imports ``deployments/``."""
