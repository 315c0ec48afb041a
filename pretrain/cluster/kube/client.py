"""An API client for the Kubernetes backend, from explicit settings or the environment — never
from (or into) the ``kubernetes`` package's global default configuration."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

IN_CLUSTER_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


class KubeUnavailable(RuntimeError):
    """No Kubernetes API is configured (or its configuration cannot be read)."""


def api_client(
    kubeconfig: str | Path | None = None,
    context: str | None = None,
    cluster_config: Any = None,
    env: Mapping[str, str] | None = None,
):
    """A ``kubernetes.client.ApiClient``. First match wins: ``cluster_config`` (a
    prefect-kubernetes ``KubernetesClusterConfig`` block: ``.config`` dict, ``.context_name``),
    ``kubeconfig`` (path), ``$KUBECONFIG`` / ``~/.kube/config`` of ``env`` (default: this
    process's), the pod's service account (in-cluster). KubeUnavailable says what to set."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    env = os.environ if env is None else env
    try:
        if cluster_config is not None:
            return config.new_client_from_config_dict(
                cluster_config.config, context=context or cluster_config.context_name
            )
        paths = [str(kubeconfig)] if kubeconfig else [p for p in (env.get("KUBECONFIG") or "").split(os.pathsep) if p]
        home = Path(env.get("HOME") or "~").expanduser() / ".kube" / "config"
        if not paths and home.is_file():
            paths = [str(home)]
        if paths:
            missing = [p for p in paths if not Path(p).is_file()]
            if missing:
                raise KubeUnavailable(
                    f"kubeconfig {', '.join(missing)} does not exist: point KUBECONFIG at your "
                    "cluster's kubeconfig file"
                )
            return config.new_client_from_config(config_file=paths[0], context=context)
        if env.get("KUBERNETES_SERVICE_HOST") and IN_CLUSTER_TOKEN.is_file():
            configuration = client.Configuration()
            config.load_incluster_config(client_configuration=configuration)
            return client.ApiClient(configuration)
    except ConfigException as e:
        raise KubeUnavailable(
            f"the Kubernetes configuration cannot be used ({e}): fix the kubeconfig or its context"
        ) from e
    raise KubeUnavailable(
        "no Kubernetes API is configured: set KUBECONFIG to your cluster's kubeconfig (or run the "
        "flow in a pod with a service account)"
    )
