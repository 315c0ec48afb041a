"""What the tests of the Kubernetes API double send it through the official client: an Indexed
Job like the backend's, a bare pod, and the ``api`` fixture (a client of the ``kube_api`` double)."""

from __future__ import annotations

import pytest
from kubernetes import client

NS = "default"
SLEEP = ["python", "-c", "import signal; signal.pause()"]  # a pod that runs until it is deleted


def job(name: str, command: list[str], nodes: int = 2, image: str = "pretrain:test", **spec) -> client.V1Job:
    """An Indexed Job like the backend's: one pod per node, pods under the Service ``train``."""
    return client.V1Job(
        metadata=client.V1ObjectMeta(name=name, labels={"app": "pretrain", "run": name}),
        spec=client.V1JobSpec(
            completion_mode="Indexed",
            completions=nodes,
            parallelism=nodes,
            **{"backoff_limit": 0, **spec},
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels={"app": "pretrain", "run": name}),
                spec=client.V1PodSpec(
                    restart_policy="Never",
                    subdomain="train",
                    containers=[client.V1Container(name="node", image=image, command=command)],
                ),
            ),
        ),
    )


def bare_pod(name: str, command: list[str], image: str = "pretrain:test", **container) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(
            restart_policy="Never", containers=[client.V1Container(name="c", image=image, command=command, **container)]
        ),
    )


@pytest.fixture
def api(kube_api):
    return kube_api.client()
