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


def test_a_killed_flow_process_s_job_is_retired_by_the_re_run_and_sigterm_leaves_no_object_and_no_process(
        kube_api, prepared_data, tmp_path, monkeypatch):
    """The flow-run process dies (SIGKILL: its Job trains on, orphaned); the re-run launches the
    stage's next attempt, deletes the orphan first (two launches never train at once) and resumes
    from the newest checkpoint. Then SIGTERM — what Prefect's cancellation does to a flow-run
    process — stops it: the Job, its pods and its Service are deleted before the process exits."""
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig()))  # the CLI's environment (Cli copies os.environ)
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")  # a loaded machine starts it slowly
    spec = kube_spec(tmp_path / "w", steps=20000)  # never reached: the orphan must not finish before the re-run
    seed_data(spec, prepared_data)
    first = Cli(tmp_path, spec, "first")
    try:
        wait_for(lambda: first_checkpoint(spec) or first.proc.poll() is not None, 240, "the first checkpoint")
        assert first.proc.poll() is None, first.output()[-3000:]
    finally:
        first.kill()  # SIGKILL to its whole process group: the pods are not in it (they run "in the cluster")
    [orphan] = objects(kube_api)["jobs"]
    assert len(live_pids(kube_api)) == 2  # the orphaned Job trains on

    second = Cli(tmp_path, spec, "second")
    try:
        wait_for(lambda: orphan not in objects(kube_api)["jobs"] and objects(kube_api)["jobs"]
                 or second.proc.poll() is not None, 240, "the re-run's own Job")
        assert second.proc.poll() is None, second.output()[-3000:]
        resumed_from = first_checkpoint(spec)
        wait_for(lambda: (first_checkpoint(spec) or 0) > resumed_from or second.proc.poll() is not None, 240,
                 "a checkpoint of the re-run's Job")
        tree = second.tree()
        os.kill(second.proc.pid, signal.SIGTERM)
        code = second.wait(180)
    finally:
        second.kill()
    output = second.output()
    assert code == 143 and "Traceback" not in output, output[-3000:]
    assert f"deleted Job default/{orphan} of an earlier launch" in output
    assert objects(kube_api) == {"jobs": [], "pods": [], "services": []}
    assert live_pids(kube_api) == []
    assert_all_exit(tree)
    events = read_all(spec.workdir_path / "jobs" / "s" / "attempt_001" / "events.jsonl")
    start = next(e for e in events if e["event"] == "start")
    assert start["source"] == "checkpoint" and 0 < start["step"] <= resumed_from, start  # the orphan's newest
