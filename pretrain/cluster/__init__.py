"""Where a stage's job runs: the ``Cluster`` interface, local processes, Kubernetes (``kube/``), the node check between
stages, ports."""
