"""Recovery time per fault kind, measured by chaos drills in one real campaign.

    python bench/recovery.py [--workdir DIR] [--d-model 128 --layers 4] [--only nan]

Runs a one-stage campaign (2 local CPU workers, flash checkpoints) in which a worker is killed
(the other kept, a warm spare takes its rank: the fast path), the saver is killed, a worker hangs
and the loss turns NaN (rolled back in process); four worker kills recovered by the fast path and
the same four with the fast path off (``fault_tolerance.fast_recovery_timeout_s: 0``: every
worker restarts, side by side; their medians are compared); the same
NaN drill with ``rollback_in_process`` off (the workers restart: the old path, side by side);
then a two-node campaign that loses a node (the world shrinks), the same with a standby node
(it takes the lost node's place) and one whose node freezes (its sockets stay open: found once its
keep-alives lapse); and four worker kills on two nodes of one worker each, fast
path (the other node's worker kept, a warm spare of the lost worker's node takes its rank) and full
restart (torch's elastic agents restart both nodes) side by side; and the one-node worker kills again
on a larger model (d_model 384, 6 layers: 130 MB of model and optimizer state, a step ~0.3 s).
Prints, per fault, the recovery path, the
detection-to-first-step recovery time and the time lost (recovery + steps redone), as recorded
in the campaign ledger, and checks the worker kill's fast path against issue 16's targets
(≤ 1.0 s, ≤ 0.5 × the full restart in the same run), the NaN rolled back in process (≤ 0.5 s), the node loss with a standby node
(``cluster.spare_nodes``) against ≤ 3 s, and without one (the world shrinks, a node killed or
frozen: the freeze to the first step, keep-alive window included) against ≤ 3 s too. ``--only nan`` / ``--only kill`` / ``--only kill-large`` /
``--only node`` / ``--only nodes-kill``: those runs alone (a quick comparison).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from statistics import median

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")  # slow to start on a loaded machine
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, run alone or by python -m bench
BENCH = {
    "title": "Recovery per fault kind",
    "order": 60,
    "quick": ["--d-model", "32", "--layers", "1"],
    "full": [],
    "timeout_s": 1800,
}

from bench.results import Check, report  # noqa: E402
from flows.campaign import pretrain_campaign  # noqa: E402
from pretrain.spec.campaign import parse_spec  # noqa: E402

DLROVER = "DLRover 0.6.1, measured here (docs/benchmarks.md): state back after a worker kill in 1.9 s (1 process) to 3.1 s (2)"
KILL_STEPS = (12, 24, 36, 48)  # the worker kills of each path's run (one kill alone is too noisy to compare)
LARGE = {
    "n_layer": 6,
    "n_head": 4,
    "d_model": 384,
    "max_seq_len": 64,
}  # 11 M parameters: 130 MB of model and AdamW state
ON_LARGE = " (d_model 384, 6 layers)"
DATA = {"sources": ["{stdlib}/json/*.py"], "max_bytes": 200_000, "tokenizer": {"vocab_size": 512}}


def spec(workdir: Path, model: dict, cluster: dict, chaos: list[dict], steps: int = 60, **fault_tolerance):
    return parse_spec(
        {
            "name": "recovery",
            "workdir": str(workdir),
            "data": DATA,
            "model": model,
            "cluster": cluster,
            "chaos": chaos,
            "stages": [{"name": "main", "steps": steps, "seq_len": 64, "micro_batch": 4, "warmup_steps": 5}],
            "checkpoint": {"interval": 10, "memory_interval": 2},
            "fault_tolerance": fault_tolerance,  # default hang timeouts: adapted to the steps
        }
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", default=None)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument(
        "--only",
        choices=["nan", "kill", "kill-large", "node", "nodes-kill"],
        help="nan: only the NaN rollback, in process and by restart; kill: only the worker kill, fast and by "
        "restart; kill-large: the same on the larger model; node: only the node loss, shrinking and with a "
        "standby node; nodes-kill: only the worker kill on two nodes, fast and by restart",
    )
    a = p.parse_args()
    root = Path(a.workdir or tempfile.mkdtemp(prefix="pretrain-recovery-"))
    model = {"n_layer": a.layers, "n_head": 4, "d_model": a.d_model, "max_seq_len": 64}
    one_node = {"workers_per_node": 2, "max_restarts": 6}
    nan = [{"kind": "nan_loss", "step": 30}]
    kill = [{"kind": "kill_worker", "step": s, "rank": 1} for s in KILL_STEPS]  # several samples per path
    kill_fast, kill_restart = (
        spec(root / "kill-fast", model, one_node, kill),
        spec(root / "kill-restart", model, one_node, kill, fast_recovery_timeout_s=0),
    )
    kill_large = [
        spec(root / "kill-large-fast", LARGE, one_node, kill),
        spec(root / "kill-large-restart", LARGE, one_node, kill, fast_recovery_timeout_s=0),
    ]
    two_nodes = {"workers_per_node": 1, "nodes_min": 2, "nodes_max": 2, "max_restarts": 6}
    nodes_kill = [
        spec(root / "two-nodes-kill-fast", model, two_nodes, kill),
        spec(root / "two-nodes-kill-restart", model, two_nodes, kill, fast_recovery_timeout_s=0),
    ]
    lose_node = [{"kind": "kill_node", "node": 1, "step": 20}]
    node_runs = [
        spec(
            root / "two-nodes",
            model,
            {"workers_per_node": 1, "nodes_min": 1, "nodes_max": 2, "max_restarts": 3},
            lose_node,
        ),
        spec(
            root / "two-nodes-standby",
            model,
            {
                "workers_per_node": 1,
                "nodes_min": 2,
                "nodes_max": 2,
                "spare_nodes": 1,
                "node_timeout_s": 2,
                "max_restarts": 3,
            },
            lose_node,
        ),
        spec(
            root / "two-nodes-frozen",
            model,
            {"workers_per_node": 1, "nodes_min": 1, "nodes_max": 2, "node_timeout_s": 2, "max_restarts": 3},
            [{"kind": "freeze_node", "node": 1, "step": 20}],
        ),
    ]
    runs = (
        [
            spec(root / "nan-in-process", model, one_node, nan),
            spec(root / "nan-restart", model, one_node, nan, rollback_in_process=False),
        ]
        if a.only == "nan"
        else [kill_fast, kill_restart]
        if a.only == "kill"
        else kill_large
        if a.only == "kill-large"
        else node_runs
        if a.only == "node"
        else nodes_kill
        if a.only == "nodes-kill"
        else [
            spec(
                root / "one-node",
                model,
                one_node,
                [
                    {"kind": "kill_worker", "step": 12, "rank": 1},
                    {"kind": "kill_saver", "step": 20},
                    {"kind": "hang_worker", "step": 28},
                    {"kind": "nan_loss", "step": 40},
                ],
            ),
            kill_fast,
            kill_restart,
            spec(root / "nan-restart", model, one_node, nan, rollback_in_process=False),
            *node_runs,
            *nodes_kill,
            *kill_large,
        ]
    )
    print(f"{'fault':16s} {'path':10s} {'action':42s} {'recovery_s':>10s} {'steps redone':>12s} {'time lost s':>11s}")
    kills: dict[
        str, dict[str, list[float]]
    ] = {}  # where (kill_checks) → recovery path → recovery_s of each worker kill
    hangs: list[float] = []  # detection_s + recovery_s of each hang
    standby: list[float] = []  # kill → first step of a node loss recovered with a standby node
    shrunk: list[float] = []  # kill → first step of a node loss without a standby (the world shrinks)
    frozen: list[float] = []  # freeze → first step (the keep-alive window, the restart without it)
    nans: list[float] = []  # anomaly found → first step of a NaN rolled back in the live workers
    for s in runs:
        status = pretrain_campaign(spec=s)
        for f in status["stages"][0]["failures"]:
            print(
                f"{f['cause']:16s} {f.get('recovery_path', '-'):10s} {f['action'][:42]:42s} "
                f"{str(f.get('recovery_s')):>10s} "
                f"{f.get('steps_redone', 0):>12d} {f['time_lost_s']:>11.2f}"
            )
            if f["cause"] == "worker_killed" and f.get("recovery_s") is not None:
                where = (
                    " on two nodes" if s.cluster.nodes_max > 1 else ON_LARGE if any(s is r for r in kill_large) else ""
                )
                kills.setdefault(where, {}).setdefault(f["recovery_path"], []).append(f["recovery_s"])
            if (
                f["cause"] == "nonfinite_loss"
                and f.get("recovery_path") == "in_process"
                and f.get("recovery_s") is not None
            ):
                nans.append(f["recovery_s"])
            if f["cause"] == "hang" and f.get("recovery_s") is not None:
                hangs.append(f.get("detection_s", 0.0) + f["recovery_s"])
            if f["cause"] == "node_lost" and f.get("recovery_path") == "spare_node" and f.get("recovery_s") is not None:
                standby.append(f["recovery_s"])
            if f["cause"] == "node_lost" and f.get("recovery_path") == "restart" and f.get("recovery_s") is not None:
                if any(d.kind == "freeze_node" for d in s.chaos):
                    frozen.append(round(f.get("detection_s", 0.0) + f["recovery_s"], 2))
                else:
                    shrunk.append(f["recovery_s"])
    print(f"reference: {DLROVER}")
    checks = kill_checks(kills.get("", {}), "") if a.only in (None, "kill") else []
    checks += kill_checks(kills.get(" on two nodes", {}), " on two nodes") if a.only in (None, "nodes-kill") else []
    checks += kill_checks(kills.get(ON_LARGE, {}), ON_LARGE) if a.only in (None, "kill-large") else []
    checks += [
        Check(
            "NaN loss → rolled back in process, first step, s",
            s,
            0.5,
            "<=",
            "the workers restore the newest memory snapshot every rank holds, then one step",
        )
        for s in nans
    ]
    checks += [
        Check(
            "hang → found and first step after recovery, s (default settings)",
            h,
            10.0,
            "<=",
            "the default adapted step timeout (floor 5 s) is most of it",
        )
        for h in hangs
    ]
    checks += [
        Check(
            "node loss → first step with a standby node, s (node_timeout_s 2)",
            s,
            3.0,
            "<=",
            "new workers on both nodes (forked, the state from the survivor's memory snapshot, one step) after the "
            "lost node's agent link closed; a node whose sockets stay open waits for its keep-alives to lapse (2 s)",
        )
        for s in standby
    ]
    checks += [
        Check(
            "node loss without a standby → first step, s (the world shrinks)",
            s,
            3.0,
            "<=",
            "the survivors' round closes once every other node of the last one is back (not after torch's 5 s last "
            "call), the state from the last world's rank-0 memory snapshot",
        )
        for s in shrunk
    ]
    checks += [
        Check(
            "frozen node without a standby → first step, s (node_timeout_s 2, from the freeze)",
            s,
            3.0,
            "<=",
            "its sockets stay open: found when its keep-alives lapse (2 s after its last one, which may precede the "
            "freeze by up to 1 s), then the survivors restart without it",
        )
        for s in frozen
    ]
    report(checks)


def kill_checks(kills: dict[str, list[float]], where: str) -> list[Check]:
    """Issue 16's targets for a worker kill: the fast path (kept survivors + spare or replacement)
    ≤ 1.0 s and ≤ 0.5 × the full restart measured in the same run; the medians of the kills each
    path recovered (one kill alone varies by ±50 % on two cores). ``where``: the runs' topology."""
    fast = (
        median(kills.get("spare", []) + kills.get("replacement", []))
        if "spare" in kills or "replacement" in kills
        else None
    )
    restart = median(kills["restart"]) if "restart" in kills else None
    if fast is None or restart is None:
        return [
            Check(
                f"worker kill{where} recovered by both paths (seen: {sorted(kills)})",
                0,
                1,
                ">=",
                "a run did not record the worker kill's recovery",
            )
        ]
    why = {
        "": "on this small model (10 MB of state) both paths are mostly the same fixed costs: the killed process's "
        "teardown (~10 ms before anyone can notice) and one training step (~50 ms); the fast path adds the "
        "survivor's interrupt, a new gloo group and the hand-over (~40 ms), a full restart forks its workers "
        "from the zygote and reads the snapshot from shared memory (~150 ms)",
        " on two nodes": "a full restart of several nodes is torch's: every agent stops its workers and meets the "
        "others in a new rendezvous round",
        ON_LARGE: "a full restart rebuilds the model and reads 130 MB of state from shared memory; the fast path "
        "sends it from the survivor over gloo (~1 GB/s here) into the warm spare's tensors",
    }[where]
    print(
        f"worker kills{where} recovered: {', '.join(f'{path} {sorted(times)}' for path, times in sorted(kills.items()))}"
    )
    return [
        Check(f"worker kill{where} → first step, fast path (median), s", fast, 1.0, "<=", why),
        Check(f"worker kill{where}: fast path / full restart (medians)", round(fast / restart, 3), 0.5, "<=", why),
    ]


if __name__ == "__main__":
    main()
