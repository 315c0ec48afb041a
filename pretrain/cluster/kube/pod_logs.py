"""``PodLogs``: the logs of a launch's pods, read from the Kubernetes API: each ended pod's log
copied once into its node's ``node<i>.log`` in the job directory, and the tails of failed pods
kept for the flow run's logs."""

from __future__ import annotations

from pathlib import Path

from pretrain.cluster.kube.pods import PodVerdict
from trainer.job.layout import JobLayout

LOG_TAIL_LINES = 2000


class PodLogs:
    def __init__(self, api, namespace: str, job_dir: Path, nodes: int):
        self.api, self.namespace = api, namespace
        self.paths = [JobLayout(job_dir).node_log(i) for i in range(nodes)]  # node index → its log file
        self.tails: dict[int, str] = {}  # failed nodes' log tails
        self._saved: set[int] = set()  # nodes whose pod log is in the job directory

    def keep(self, v: PodVerdict, failed: bool = True) -> None:
        """Copy the pod's log into ``node<i>.log`` once; a failed pod's tail (or, when its
        container never started, what went wrong) is kept for the flow run's logs."""
        if v.index is None or v.index in self._saved or v.index >= len(self.paths):
            return
        text = self.read(v.name)
        if failed:
            self.tails[v.index] = "".join(text.splitlines(keepends=True)[-50:]) if text else v.message
        if text is None:
            return
        self._saved.add(v.index)
        self.paths[v.index].parent.mkdir(parents=True, exist_ok=True)
        with open(self.paths[v.index], "a", encoding="utf-8") as f:
            f.write(text)

    def read(self, pod: str) -> str | None:
        """The end of ``pod``'s log; None when it has none (never started, or gone)."""
        from kubernetes import client

        try:
            return client.CoreV1Api(self.api).read_namespaced_pod_log(pod, self.namespace, tail_lines=LOG_TAIL_LINES)
        except client.ApiException as e:
            return None if e.status in (400, 404) else f"(log of pod {pod} unavailable: {e.status} {e.reason})\n"
        except Exception as e:  # noqa: BLE001 — the API went away: the log is lost, the job is not
            return f"(log of pod {pod} unavailable: {type(e).__name__})\n"
