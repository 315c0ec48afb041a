"""Launching stages on the Kubernetes API test double (``kube_api``) as the scenario tests do
(test_kube_cluster.py and the other test_kube_*.py): a spec for the double, a launch of its first
stage, and what is left of it (the API's objects, the pods' live processes)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import psutil

from pretrain.cluster.kube.cluster import KubeCluster
from pretrain.cluster.ports import free_port
from pretrain.run.jobs import build_job, write_job
from support import kube_api as double
from support.campaigns import seed_data, small_spec

NS = "default"
IMAGE = "pretrain:test"
# the manifests run `sh -c "exec python -m trainer.launch …"`: the image's `python` is this machine's
IMAGE_PATH = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def kube_spec(workdir, steps: int = 6, max_restarts: int = 0, cluster: dict | None = None, chaos: tuple = (), **kube):
    """One stage on 2 nodes × 1 worker (nodes_min 1; ``cluster``: other settings), checkpoints every
    2 steps; its own rendezvous port."""
    return small_spec(
        workdir,
        chaos=list(chaos),
        cluster={
            "kind": "kubernetes",
            "workers_per_node": 1,
            "nodes_min": 1,
            "nodes_max": 2,
            "max_restarts": max_restarts,
            "threads_per_worker": 1,
            **(cluster or {}),
            "kubernetes": {
                "image": IMAGE,
                "cpu_per_node": "1",
                "memory_per_node": "4Gi",
                "env": {"PATH": IMAGE_PATH},
                "rdzv_port": free_port(span=2),
                **kube,
            },
        },  # node check: the next port
        stages=[{"name": "s", "steps": steps, "seq_len": 32, "micro_batch": 2, "warmup_steps": 1}],
        checkpoint={"interval": 2, "memory_interval": 0, "keep": 4},
    )


def launch(api: double.KubeAPI, spec, prepared_data, attempt: int = 1):
    seed_data(spec, prepared_data)
    job = build_job(spec, 0, attempt, None)
    path = write_job(job)
    cluster = KubeCluster(spec, api.client(), unschedulable_after_s=2.0)
    return cluster, job, path


def objects(api: double.KubeAPI) -> dict[str, list[str]]:
    return {p: [o["metadata"]["name"] for o in api.store.find(p, NS)] for p in ("jobs", "pods", "services")}


def live_pids(api: double.KubeAPI) -> list[int]:
    return [
        pid
        for pid in api.runner.pids
        if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    ]
