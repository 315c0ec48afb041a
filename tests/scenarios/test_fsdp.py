"""FSDP2 sharded training state: per-rank pieces in shared memory and storage, exact restore
after a killed worker, consolidation for validation, evaluation and DDP stages, resharding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_chaos import chaos_spec
from test_flash import start_saver

from flows.campaign import pretrain_campaign
from pretrain.run.jobs import checkpoint_store, model_config
from support.campaigns import assert_no_duplicate_metric_steps, campaign_data_dir, wait_for
from support.fsdp_ranks import job
from support.jobs import CPU0, assert_same
from trainer.checkpoint import state
from trainer.checkpoint import store as ckpt
from trainer.checkpoint.flash import SnapshotStore
from trainer.checkpoint.sharded import PIECE, ShardLayoutError, chunk_bounds, consolidate, load_full_state
from trainer.data.sampler import read_manifest
from trainer.evaluate import evaluate, validate
from trainer.job.reporting import read_all
from trainer.loop import build_model

RANKS = Path(__file__).parents[1] / "support" / "fsdp_ranks.py"


# ---- pieces and consolidation, no processes ----------------------------------------------------
def test_chunk_bounds_follow_torch_chunk():
    for n in (0, 1, 5, 7, 8, 65):
        for world in (1, 2, 3, 4, 5):
            chunks = torch.arange(n).chunk(world) if n else ()
            for rank in range(world):
                offset, length = chunk_bounds(n, world, rank)
                want = chunks[rank].tolist() if rank < len(chunks) else []
                assert list(range(offset, offset + length)) == want, (n, world, rank)


def piece(full: torch.Tensor, world: int, rank: int) -> dict:
    offset, length = chunk_bounds(full.shape[0], world, rank)
    return {PIECE: full[offset : offset + length], "shape": list(full.shape), "dim": 0, "offset": offset}


def test_consolidate_joins_pieces_and_names_what_does_not_fit():
    w = torch.randn(5, 3)
    ranks = [{"model": {"w": piece(w, 2, r), "step": torch.tensor(4.0)}, "step": 4} for r in (1, 0)]
    full = consolidate(ranks)
    assert torch.equal(full["model"]["w"], w) and full["step"] == 4
    with pytest.raises(ShardLayoutError, match=r"state.model.w: the shards cover 3 of 5 rows"):
        consolidate(ranks[1:])
    with pytest.raises(ShardLayoutError, match=r"state.model.w: rows 3..2 .* overlap"):
        consolidate([{"model": {"w": piece(w, 2, 0)}}, {"model": {"w": piece(w, 3, 1)}}])


def test_an_incomplete_sharded_checkpoint_is_rejected_with_both_names(tmp_path):
    store = ckpt.CheckpointStore.open(tmp_path / "ckpt")
    w = torch.randn(4, 2)
    entries = [
        store.write_shard(
            2, ckpt.model_shard_name(0), {"model": {"w": piece(w, 2, 0)}, "optimizer": {}, "scheduler": {}, "step": 2}
        ),
        store.write_shard(2, ckpt.rank_shard_name(0), {"consumed": 4}),
    ]
    store.commit(2, entries, {"world_size": 2})
    with pytest.raises(ShardLayoutError, match=r"world_size 2, found pieces of ranks \[0\]"):
        load_full_state(store, 2)
    verdict = validate(store.ref(2).location, job(tmp_path).model)
    assert not verdict.ok and any("no model state" in p and "world_size 2" in p for p in verdict.problems)


def test_a_sharded_checkpoint_commits_only_when_every_ranks_piece_is_persisted(tmp_path):
    """Two nodes of one rank each: the first node's saver persists its piece but cannot commit;
    the checkpoint appears when the second node's saver has persisted the other piece."""
    w = torch.randn(5, 3)
    for rank in (0, 1):
        snaps = SnapshotStore(tmp_path / f"node{rank}", 0, rank, 2, capacity=1 << 16)
        snaps.snapshot(
            4,
            {
                "shard": {"model": {"w": piece(w, 2, rank)}, "optimizer": {}, "scheduler": {}, "step": 4},
                "rank": {"consumed": 8, "step": 4, "rank": rank},
            },
            persist=True,
        )
        snaps.flush()
    store = ckpt.CheckpointStore.open(tmp_path / "ckpt")
    first = start_saver(tmp_path, tmp_path / "node0")
    try:
        wait_for(lambda: store.node_shards(4), 60, "node 0's saver to persist its piece")
        assert store.read_pointer() is None and store.manifest(4) is None
        second = start_saver(tmp_path, tmp_path / "node1")
        try:
            wait_for(lambda: store.read_pointer() == 4, 60, "the commit of step 4")
        finally:
            second.terminate()
            second.wait(30)
    finally:
        first.terminate()
        first.wait(30)
    assert store.manifest(4).meta["parallelism"] == "fsdp" and store.verify(4) == []
    assert torch.equal(load_full_state(store, 4)["model"]["w"], w)


# ---- real processes: 2 gloo ranks ------------------------------------------------------------
def run_ranks(mode: str, root: Path, world: int, timeout: float = 240, script: Path = RANKS) -> list[dict]:
    """Run ``SCRIPT MODE ROOT`` (``fsdp_ranks.py`` unless told) as ``world`` ranks around a store
    hosted here; a rank that fails ends the others (they would wait for it in a collective)."""
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), mode, str(root)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}
        )
        for r in range(world)
    ]
    try:
        wait_for(
            lambda: all(p.poll() is not None for p in procs) or any(p.poll() for p in procs),
            timeout,
            f"{world} ranks of {mode!r}",
        )
        codes = [p.poll() for p in procs]
        assert codes == [0] * world, f"ranks of {mode!r} exited {codes}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads((root / f"result_{mode}_{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-rank FSDP run: step 3 checkpointed to storage, step 4 snapshotted to memory, and the
    restores from both checked bit for bit inside the ranks."""
    root = tmp_path_factory.mktemp("fsdp")
    return root, run_ranks("train", root, world=2)


def test_each_rank_restores_its_pieces_from_memory_and_from_storage(trained):
    root, results = trained
    for r in results:
        assert r["memory"] == ["memory", 4, 16] and r["storage"] == ["checkpoint", 3, 12]
        assert r["live"] == ["memory", 4, 16]  # the in-process rollback's restore into live FSDP modules
    store = ckpt.CheckpointStore.open(root / "ckpt")
    manifest = store.manifest(3)
    assert manifest.meta["parallelism"] == "fsdp" and ckpt.MODEL_SHARD not in manifest.files
    assert ckpt.model_files(list(manifest.files), 2) == [ckpt.model_shard_name(0), ckpt.model_shard_name(1)]


def test_consolidated_state_is_the_full_model_and_validates(trained):
    root, _ = trained
    store = ckpt.CheckpointStore.open(root / "ckpt")
    full = load_full_state(store, 3)
    assert_same(full["model"], torch.load(root / "full_step3.pt", weights_only=True))
    assert full["step"] == 3 and full["scheduler"]["step"] == 3
    params = dict(build_model(job(root, "ddp"), torch.device("cpu"))[0].named_parameters())
    for moments in full["optimizer"]["state"].values():  # whole AdamW moments, not pieces
        assert moments["exp_avg"].shape in {p.shape for p in params.values()}
    verdict = validate(store.ref(3).location, job(root).model)
    assert verdict.ok, verdict.problems


def test_fsdp_checkpoint_starts_or_resumes_a_ddp_run(trained, tmp_path):
    root, _ = trained
    full = load_full_state(ckpt.CheckpointStore.open(root / "ckpt"), 3)
    ddp = job(root, "ddp").amended(
        checkpoint={"location": str(tmp_path / "next")}, stage={"init_from": str(root / "ckpt" / "step_00000003")}
    )
    model, opt = build_model(ddp, torch.device("cpu"))
    got = state.restore(ddp, CPU0, model=model, optimizer=opt)
    assert (got.source, got.step) == ("init_from", 0)
    assert_same(model.state_dict(), full["model"])
    assert_same(opt.state_dict()["state"], full["optimizer"]["state"])

    model, opt = build_model(job(root, "ddp"), torch.device("cpu"))  # the FSDP stage, resumed under DDP on 1 rank
    got = state.restore(job(root, "ddp"), CPU0, model=model, optimizer=opt)
    assert (got.source, got.step, got.consumed) == ("checkpoint", 3, 12)
    assert_same(model.state_dict(), full["model"])


@pytest.mark.parametrize("world", [1, 3])
def test_fsdp_and_ddp_checkpoints_reshard_into_fsdp_of_another_size(trained, world):
    """2-rank FSDP → 1- or 3-rank FSDP (resume), and DDP → FSDP (init_from): the pieces of the
    new world (uneven for 3) consolidate to the same model and optimizer state."""
    root, _ = trained
    full = load_full_state(ckpt.CheckpointStore.open(root / "ckpt"), 3)
    ddp = job(root, "ddp").amended(checkpoint={"location": str(root / "ddp_ckpt")})
    model, opt = build_model(ddp, torch.device("cpu"))
    state.restore(job(root, "ddp"), CPU0, model=model, optimizer=opt)
    state.save(ddp, CPU0, step=3, consumed=12, model=model, optimizer=opt)  # the same state, as DDP writes it
    assert ckpt.MODEL_SHARD in ckpt.CheckpointStore.open(root / "ddp_ckpt").manifest(3).files
    results = run_ranks("reshard", root, world=world)
    for r in results:
        assert r["fsdp"] == ["checkpoint", 3, 12] and r["ddp"] == ["init_from", 0, 0]
    for source in ("fsdp", "ddp"):
        got = consolidate(
            [torch.load(root / f"resharded_from_{source}_{world}_{r}.pt", weights_only=True) for r in range(world)]
        )
        assert_same(got["model"], full["model"])
        assert_same(got["optimizer"]["state"], full["optimizer"]["state"])


# ---- a campaign: killed worker, restore from memory, bitwise equal to a fault-free run ----------
FSDP = {"workers_per_node": 2, "max_restarts": 3, "parallelism": "fsdp"}
SHORT = [{"name": "main", "steps": 8, "seq_len": 32, "micro_batch": 4, "warmup_steps": 3, "grad_accum": 2}]


def fsdp_spec(path, prepared_data, **overrides):
    return chaos_spec(path, prepared_data, stages=SHORT, cluster=FSDP, **overrides)


def final_full_model(spec) -> dict:
    store = checkpoint_store(spec, "main")
    return load_full_state(store, store.read_pointer())["model"]


def test_fsdp_worker_killed_after_a_snapshot_resumes_from_memory_bit_exact(prefect_harness, prepared_data, tmp_path):
    drilled = fsdp_spec(tmp_path / "drilled", prepared_data, chaos=[{"kind": "kill_worker", "step": 5, "rank": 1}])
    status = pretrain_campaign(spec=drilled)
    assert_no_duplicate_metric_steps(drilled.tracking_uri)
    stage = status["stages"][0]
    assert status["status"] == "completed" and stage["steps_done"] == 8 and stage["attempts"] == 1
    assert [f["cause"] for f in stage["failures"]] == ["worker_killed"]
    events = read_all(drilled.workdir_path / "jobs" / "main" / "attempt_000" / "events.jsonl")
    # the newest snapshot every rank holds sealed when rank 1 dies at step 5: step 4's, or step 2's
    # when the other rank was still copying step 4's as the restart stopped it (a loaded machine)
    starts = [e for e in events if e["event"] == "start" and e["restart_count"] == 1]
    assert len({(e["source"], e["step"]) for e in starts}) == 1 and starts[0]["source"] == "memory"
    assert starts[0]["step"] in (2, 4)

    store = checkpoint_store(drilled, "main")
    final = store.ref(store.read_pointer()).location
    assert store.manifest(8).meta["parallelism"] == "fsdp"
    data_dir = campaign_data_dir(drilled)
    model_cfg = model_config(drilled, read_manifest(data_dir)["vocab_size"])
    assert validate(final, model_cfg).ok
    batches = drilled.validation.eval_batches
    assert (
        evaluate(final, model_cfg, data_dir, seq_len=32, max_batches=batches)["val_loss"] == stage["eval"]["val_loss"]
    )

    clean = fsdp_spec(tmp_path / "clean", prepared_data)
    assert pretrain_campaign(spec=clean)["stages"][0]["failures"] == []
    assert_same(final_full_model(drilled), final_full_model(clean))
