"""Kubernetes campaigns end to end through the API test double: the campaign flow (node check in
pods, training Job, teardown) with the real node agent in every pod. Few and short: the backend's
own behaviour is tested at job level in test_kube_cluster.py."""

from __future__ import annotations

import os
import signal
import threading

from kubernetes import client

import kube_api as double
from conftest import seed_data, wait_for
from pretrain.kube.pods import INDEX
from pretrain.layout import CampaignLayout
from test_interrupt import Cli
from test_kube_cluster import NS, kube_spec, live_pids, objects
from test_resume import assert_all_exit
from trainer.checkpoint.store import CheckpointStore
from trainer.reporting import read_all

kube_api = double.kube_api  # the fixture


def training_pod(api: double.KubeAPI, index: int) -> str | None:
    """The name of the training (not node-check) pod of ``index``, if it exists."""
    for pod in api.store.find("pods", NS):
        meta = pod["metadata"]
        if "pretrain.io/stage" in meta["labels"] and (meta.get("annotations") or {}).get(INDEX) == str(index):
            return meta["name"]
    return None


def first_checkpoint(spec):
    return CheckpointStore.open(CampaignLayout(spec.workdir_path).ckpt_dir("s")).read_pointer()


def test_a_pod_deleted_mid_campaign_the_stage_goes_on_without_it_and_completes(prefect_harness, kube_api, prepared_data,
                                                                             tmp_path, monkeypatch):
    from flows.campaign import pretrain_campaign

    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig()))
    spec = kube_spec(tmp_path / "w", steps=200, max_restarts=2)  # rejoin_after_s 60: the survivor finishes alone
    seed_data(spec, prepared_data)
    deleted: list[str] = []
    done = threading.Event()

    def delete_node_1() -> None:  # what a node drain or `kubectl delete pod` does, once training has a checkpoint
        while not done.is_set():
            pod = training_pod(kube_api, 1)
            if pod and first_checkpoint(spec):
                client.CoreV1Api(kube_api.client()).delete_namespaced_pod(pod, NS)
                deleted.append(pod)
                return
            done.wait(0.1)  # polls the checkpoint pointer and the pods
    chaos = threading.Thread(target=delete_node_1, daemon=True)
    chaos.start()
    try:
        status = pretrain_campaign(spec=spec)
    finally:
        done.set()
        chaos.join(10)
    assert deleted, "the pod was never deleted: the stage ended before its first checkpoint was seen"
    stage = status["stages"][0]
    assert status["status"] == "completed" and stage["steps_done"] == 200 and stage["attempts"] == 1, status
    assert [f["cause"] for f in stage["failures"]][:1] == ["node_lost"], stage["failures"]
    metrics = read_all(spec.workdir_path / "jobs" / "s" / "attempt_000" / "metrics.jsonl")
    final = {m["step"]: m for m in metrics}
    assert sorted(final) == list(range(1, 201)) and final[200]["world_size"] == 1  # node 0 finished alone
    assert objects(kube_api) == {"jobs": [], "pods": [], "services": []}
    assert live_pids(kube_api) == []


def test_sigterm_to_the_flow_process_of_a_kubernetes_campaign_leaves_no_object_and_no_process(
        kube_api, prepared_data, tmp_path, monkeypatch):
    """What Prefect's cancellation does to a flow-run process (SIGTERM): the job is stopped with a
    save at breakpoint and its Job, pods and Service are deleted before the process exits."""
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig()))  # the CLI's environment (Cli copies os.environ)
    spec = kube_spec(tmp_path / "w", steps=2000)
    seed_data(spec, prepared_data)
    cli = Cli(tmp_path, spec, "run")
    try:
        wait_for(lambda: first_checkpoint(spec) or cli.proc.poll() is not None, 240, "the first checkpoint")
        assert cli.proc.poll() is None, cli.output()[-3000:]
        assert objects(kube_api)["jobs"] and len(live_pids(kube_api)) == 2
        tree = cli.tree()
        os.kill(cli.proc.pid, signal.SIGTERM)
        code = cli.wait(180)
    finally:
        cli.kill()
    output = cli.output()
    assert code == 143 and "Traceback" not in output, output[-3000:]
    assert objects(kube_api) == {"jobs": [], "pods": [], "services": []}
    assert live_pids(kube_api) == []
    assert_all_exit(tree)
    events = read_all(spec.workdir_path / "jobs" / "s" / "attempt_000" / "events.jsonl")
    saved = max(e["step"] for e in events if e["event"] == "checkpoint")
    assert saved == first_checkpoint(spec) and saved < 2000  # the newest checkpoint is committed and the pointer names it
