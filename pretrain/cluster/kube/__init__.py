"""Kubernetes as a cluster backend: one Indexed Job per stage launch. ``manifests`` (what is
created: pure, no API calls), ``rbac`` (the role it needs), ``client`` (the official client from a
kubeconfig or in-cluster), ``preflight`` (what is checked before anything is created),
``cluster`` (``KubeCluster``: start, adopt, retire), ``handle`` with ``watch`` and ``pod_logs``
(one launch), ``pods`` (a pod's verdict), ``nodecheck`` (the node check in pods of the training pods' shape)."""
