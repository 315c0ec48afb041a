"""Kubernetes campaigns end to end through the API test double: the campaign flow (node check in
pods, training Job, teardown) with the real node agent in every pod. Few and short: the backend's
own behaviour is tested at job level in test_kube_cluster.py."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import psutil
import pytest
from kubernetes import client
from test_interrupt import Cli
from test_kube_cluster import NS, kube_spec, live_pids, objects
from test_resume import assert_all_exit

from pretrain.cluster.kube.pods import INDEX
from pretrain.spec.campaign import parse_spec
from pretrain.state.ledger import Ledger
from support import kube_api as double
from support.campaigns import kept_trajectory, run_to_completion, seed_data, wait_for
from trainer.checkpoint.store import CheckpointStore
from trainer.job.reporting import read_all

kube_api = double.kube_api  # the fixture


def training_pod(api: double.KubeAPI, index: int) -> str | None:
    """The name of the training (not node-check) pod of ``index``, if it exists."""
    for pod in api.store.find("pods", NS):
        meta = pod["metadata"]
        if "pretrain.io/stage" in meta["labels"] and (meta.get("annotations") or {}).get(INDEX) == str(index):
            return meta["name"]
    return None


def first_checkpoint(spec):
    return CheckpointStore.open(spec.layout.ckpt_dir("s")).read_pointer()


# the pod is deleted at the first checkpoint (step 2, ~0.1 s a step): the survivor trains the
# rest alone, seconds of steps in which the deletion must land however loaded the machine is
STEPS_LEFT_ALONE = 80


@pytest.mark.slow  # the campaign around test_kube_cluster::test_a_pod_deleted_mid_training_is_a_lost_node_and_…
def test_a_pod_deleted_mid_campaign_the_stage_goes_on_without_it_and_completes(
    prefect_harness, kube_api, prepared_data, tmp_path, monkeypatch
):
    from flows.campaign import pretrain_campaign

    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig()))
    # rejoin_after_s 0: the survivor finishes alone (with the default 60 s, a busy machine once had
    # node 1 rejoin first, in a second attempt)
    spec = kube_spec(tmp_path / "w", steps=STEPS_LEFT_ALONE, max_restarts=2, cluster={"rejoin_after_s": 0})
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
    assert status["status"] == "completed" and stage["steps_done"] == STEPS_LEFT_ALONE and stage["attempts"] == 1, (
        status
    )
    assert [f["cause"] for f in stage["failures"]][:1] == ["node_lost"], stage["failures"]
    metrics = read_all(spec.workdir_path / "jobs" / "s" / "attempt_000" / "metrics.jsonl")
    assert kept_trajectory(metrics, STEPS_LEFT_ALONE)[STEPS_LEFT_ALONE]["world_size"] == 1  # node 0 finished alone
    assert objects(kube_api) == {"jobs": [], "pods": [], "services": []}
    assert live_pids(kube_api) == []


@pytest.mark.slow  # on pods what test_elastic::test_a_standby_node_takes_a_lost_nodes_place_… asserts bit-exact
def test_a_standby_pod_takes_a_lost_pods_place_and_the_world_keeps_its_size(
    prefect_harness, kube_api, prepared_data, tmp_path, monkeypatch
):
    """``spare_nodes`` on Kubernetes: the Job has a third pod that stands by. When node 1's pod
    dies at step 12 the standby joins the next round in its place: ``nodes_min`` is 2, so without
    it the job would fail and be relaunched; with it the stage completes in its first attempt,
    every step on 2 workers, every sample once, and the Job's pods all end."""
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig()))
    spec = kube_spec(
        tmp_path / "w",
        steps=24,
        max_restarts=3,
        cluster={"nodes_min": 2, "nodes_max": 2, "spare_nodes": 1},
        chaos=[{"kind": "kill_node", "node": 1, "step": 12}],
    )
    stage = run_to_completion(spec, prepared_data, attempts=1)
    assert [f["recovery_path"] for f in stage["failures"] if f["cause"] == "node_lost"] == ["spare_node"], stage[
        "failures"
    ]
    job = spec.workdir_path / "jobs" / "s" / "attempt_000"
    metrics = read_all(job / "metrics.jsonl")
    kept_trajectory(metrics, 24, global_batch=4)  # 2 workers × 2
    assert {m["world_size"] for m in metrics} == {2}
    starts = [e for e in read_all(job / "events.jsonl") if e["event"] == "start"]
    assert {e["node"] for e in starts if e["step"] == 0} == {0, 1}  # the standby pod waited out the first round
    assert {e["node"] for e in starts if e["step"] > 0} == {0, 2}
    assert objects(kube_api) == {"jobs": [], "pods": [], "services": []}
    assert live_pids(kube_api) == []


def workers(api: double.KubeAPI) -> list[psutil.Process]:
    """The training worker processes of the pods (not their agents, savers, warm spares or the node check)."""
    found = []
    for pid in live_pids(api):
        with contextlib.suppress(psutil.Error):  # it ended meanwhile (e.g. a node check's pod)
            for child in psutil.Process(pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):  # a child that ended meanwhile
                    if "trainer.worker" in (line := " ".join(child.cmdline())) and "--spare" not in line:
                        found.append(child)
    return found


STEPS = 48  # a synchronous checkpoint every 2 steps: ~0.15 s a step, frozen at the first checkpoint


def test_a_killed_flow_process_s_job_is_adopted_by_the_re_run_and_the_stage_completes(
    prefect_harness, kube_api, prepared_data, tmp_path, monkeypatch
):
    """The flow-run process dies (SIGKILL: its Job trains on, orphaned); the re-run finds the Job of
    the stage's last attempt alive and takes it back: the same Job object finishes the stage, no
    attempt is counted, no second Job is created. The orphan's workers are frozen until the re-run
    has adopted it, so it cannot finish first however slowly the re-run starts (the hang detector's
    fixed timeout, not an adaptive one, so the frozen steps are no hang)."""
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig()))  # the CLI's environment (Cli copies os.environ)
    spec = kube_spec(tmp_path / "w", steps=STEPS)  # seconds of steps: the orphan is frozen long before its end
    spec = parse_spec({**spec.model_dump(mode="json"), "fault_tolerance": {"hang_timeout_factor": 0}})
    seed_data(spec, prepared_data)
    first, frozen = Cli(tmp_path, spec, "first"), []
    try:
        wait_for(lambda: first_checkpoint(spec) or first.proc.poll() is not None, 240, "the first checkpoint")
        assert first.proc.poll() is None, first.output()[-3000:]
        frozen = workers(kube_api)
        for w in frozen:
            w.suspend()
    finally:
        first.kill()  # SIGKILL to its whole process group: the pods are not in it (they run "in the cluster")
    assert len(frozen) == 2, frozen  # 2 nodes × 1 worker
    [orphan] = objects(kube_api)["jobs"]
    uid = kube_api.store.get("jobs", NS, orphan)["metadata"]["uid"]
    second = Cli(tmp_path, spec, "second")
    try:
        wait_for(
            lambda: "adopted the live Job" in second.output() or second.proc.poll() is not None,
            240,
            "the re-run adopting the Job",
        )
        assert (
            objects(kube_api)["jobs"] == [orphan] and kube_api.store.get("jobs", NS, orphan)["metadata"]["uid"] == uid
        )
        for w in frozen:
            w.resume()
        code = second.wait(300)
    finally:
        for w in frozen:
            with contextlib.suppress(psutil.NoSuchProcess):
                w.resume()
        second.kill()
    output = second.output()
    assert code == 0 and "Traceback" not in output, output[-3000:]
    assert f"adopted the live Job default/{orphan} of attempt 0" in output
    stage = Ledger.read(spec.layout).record.stages["s"]
    assert stage.status == "completed" and stage.attempts == 1 and stage.failures == [], stage
    assert not (spec.workdir_path / "jobs" / "s" / "attempt_001").exists()
    assert max(m["step"] for m in read_all(spec.workdir_path / "jobs" / "s" / "attempt_000" / "metrics.jsonl")) == STEPS
    assert objects(kube_api) == {"jobs": [], "pods": [], "services": []}
    assert live_pids(kube_api) == []


def test_sigterm_to_the_flow_process_leaves_no_object_and_no_process(
    prefect_harness, kube_api, prepared_data, tmp_path, monkeypatch
):
    """SIGTERM — what Prefect's cancellation does to a flow-run process — while its stage's Job
    trains: the Job, its pods and its Service are deleted before the process exits."""
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig()))
    spec = kube_spec(tmp_path / "w", steps=20000)  # never reached
    seed_data(spec, prepared_data)
    run = Cli(tmp_path, spec, "run")
    try:
        wait_for(lambda: workers(kube_api) or run.proc.poll() is not None, 240, "the training workers")
        assert run.proc.poll() is None, run.output()[-3000:]
        tree = run.tree()
        os.kill(run.proc.pid, signal.SIGTERM)
        code = run.wait(180)
    finally:
        run.kill()
    output = run.output()
    assert code == 143 and "Traceback" not in output, output[-3000:]
    assert objects(kube_api) == {"jobs": [], "pods": [], "services": []}
    assert live_pids(kube_api) == []
    assert_all_exit(tree)
