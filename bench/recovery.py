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
(≤ 1.0 s, ≤ 0.5 × the full restart in the same run), the NaN rolled back in process (≤ 0.5 s), the node loss with a
standby node (``cluster.spare_nodes``) against ≤ 3 s, and without one (the world shrinks, a node killed or
frozen: the freeze to the first step, keep-alive window included) against ≤ 3 s too.
``--only nan`` / ``--only kill`` / ``--only kill-large`` / ``--only node`` / ``--only nodes-kill``: those runs alone
(a quick comparison).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass, field
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

DLROVER = (
    "DLRover 0.6.1, measured here (docs/benchmarks.md): "
    "state back after a worker kill in 1.9 s (1 process) to 3.1 s (2)"
)
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


ONE_NODE = {"workers_per_node": 2, "max_restarts": 6}
TWO_NODES = {"workers_per_node": 1, "nodes_min": 2, "nodes_max": 2, "max_restarts": 6}
NAN = [{"kind": "nan_loss", "step": 30}]
KILLS = [{"kind": "kill_worker", "step": s, "rank": 1} for s in KILL_STEPS]  # several samples per path
LOSE_NODE = [{"kind": "kill_node", "node": 1, "step": 20}]
EVERY_FAULT = [
    {"kind": "kill_worker", "step": 12, "rank": 1},
    {"kind": "kill_saver", "step": 20},
    {"kind": "hang_worker", "step": 28},
    {"kind": "nan_loss", "step": 40},
]
# the checks of the other recoveries, one per sample: Samples' field → (what, target s, why)
TARGETS = {
    "nans": (
        "NaN loss → rolled back in process, first step, s",
        0.5,
        "the workers restore the newest memory snapshot every rank holds, then one step",
    ),
    "hangs": (
        "hang → found and first step after recovery, s (default settings)",
        10.0,
        "the default adapted step timeout (floor 5 s) is most of it",
    ),
    "standby": (
        "node loss → first step with a standby node, s (node_timeout_s 2)",
        3.0,
        "new workers on both nodes (forked, the state from the survivor's memory snapshot, one step) after the "
        "lost node's agent link closed; a node whose sockets stay open waits for its keep-alives to lapse (2 s)",
    ),
    "shrunk": (
        "node loss without a standby → first step, s (the world shrinks)",
        3.0,
        "the survivors' round closes once every other node of the last one is back (not after torch's 5 s last "
        "call), the state from the last world's rank-0 memory snapshot",
    ),
    "frozen": (
        "frozen node without a standby → first step, s (node_timeout_s 2, from the freeze)",
        3.0,
        "its sockets stay open: found when its keep-alives lapse (2 s after its last one, which may precede the "
        "freeze by up to 1 s), then the survivors restart without it",
    ),
}


def parse_args() -> argparse.Namespace:
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
    return p.parse_args()


def kill_pair(root: Path, name: str, model: dict, cluster: dict) -> list:
    """The worker kills recovered by the fast path, and the same with it off (every worker restarts)."""
    return [
        spec(root / f"{name}-fast", model, cluster, KILLS),
        spec(root / f"{name}-restart", model, cluster, KILLS, fast_recovery_timeout_s=0),
    ]


def node_loss_runs(root: Path, model: dict) -> list:
    """Two nodes, one lost: the world shrinks, a standby node takes its place, or the node freezes."""
    return [
        spec(
            root / "two-nodes",
            model,
            {"workers_per_node": 1, "nodes_min": 1, "nodes_max": 2, "max_restarts": 3},
            LOSE_NODE,
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
            LOSE_NODE,
        ),
        spec(
            root / "two-nodes-frozen",
            model,
            {"workers_per_node": 1, "nodes_min": 1, "nodes_max": 2, "node_timeout_s": 2, "max_restarts": 3},
            [{"kind": "freeze_node", "node": 1, "step": 20}],
        ),
    ]


def planned_runs(only: str | None, root: Path, model: dict) -> tuple[list, list]:
    """The campaigns ``--only`` asks for (None: all of them), and the larger model's runs (their
    worker kills are checked apart)."""
    kill = kill_pair(root, "kill", model, ONE_NODE)
    kill_large = kill_pair(root, "kill-large", LARGE, ONE_NODE)
    nodes_kill = kill_pair(root, "two-nodes-kill", model, TWO_NODES)
    node_runs = node_loss_runs(root, model)
    nan_restart = spec(root / "nan-restart", model, ONE_NODE, NAN, rollback_in_process=False)
    if only == "nan":
        return [spec(root / "nan-in-process", model, ONE_NODE, NAN), nan_restart], kill_large
    if only:
        return {"kill": kill, "kill-large": kill_large, "node": node_runs, "nodes-kill": nodes_kill}[only], kill_large
    every_fault = spec(root / "one-node", model, ONE_NODE, EVERY_FAULT)
    return [every_fault, *kill, nan_restart, *node_runs, *nodes_kill, *kill_large], kill_large


@dataclass
class Samples:
    """The recovery times the campaigns' ledgers recorded, by fault kind."""

    kills: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # where (kill_checks) → path → recovery_s
    hangs: list[float] = field(default_factory=list)  # detection_s + recovery_s of each hang
    standby: list[float] = field(default_factory=list)  # kill → first step of a node loss with a standby node
    shrunk: list[float] = field(default_factory=list)  # kill → first step of a node loss without one (world shrinks)
    frozen: list[float] = field(default_factory=list)  # freeze → first step (the keep-alive window, the restart)
    nans: list[float] = field(default_factory=list)  # anomaly found → first step of a NaN rolled back in process

    def add(self, s, f: dict, kill_large: list) -> None:
        """Count failure ``f`` of campaign ``s`` where it belongs (if it recorded its recovery)."""
        if f["cause"] == "worker_killed" and f.get("recovery_s") is not None:
            where = " on two nodes" if s.cluster.nodes_max > 1 else ON_LARGE if any(s is r for r in kill_large) else ""
            self.kills.setdefault(where, {}).setdefault(f["recovery_path"], []).append(f["recovery_s"])
        if (
            f["cause"] == "nonfinite_loss"
            and f.get("recovery_path") == "in_process"
            and f.get("recovery_s") is not None
        ):
            self.nans.append(f["recovery_s"])
        if f["cause"] == "hang" and f.get("recovery_s") is not None:
            self.hangs.append(f.get("detection_s", 0.0) + f["recovery_s"])
        if f["cause"] == "node_lost" and f.get("recovery_path") == "spare_node" and f.get("recovery_s") is not None:
            self.standby.append(f["recovery_s"])
        if f["cause"] == "node_lost" and f.get("recovery_path") == "restart" and f.get("recovery_s") is not None:
            if any(d.kind == "freeze_node" for d in s.chaos):
                self.frozen.append(round(f.get("detection_s", 0.0) + f["recovery_s"], 2))
            else:
                self.shrunk.append(f["recovery_s"])


def run_campaigns(runs: list, kill_large: list) -> Samples:
    """Run each campaign; print a row per failure its ledger recorded."""
    print(f"{'fault':16s} {'path':10s} {'action':42s} {'recovery_s':>10s} {'steps redone':>12s} {'time lost s':>11s}")
    samples = Samples()
    for s in runs:
        status = pretrain_campaign(spec=s)
        for f in status["stages"][0]["failures"]:
            print(
                f"{f['cause']:16s} {f.get('recovery_path', '-'):10s} {f['action'][:42]:42s} "
                f"{str(f.get('recovery_s')):>10s} "
                f"{f.get('steps_redone', 0):>12d} {f['time_lost_s']:>11.2f}"
            )
            samples.add(s, f, kill_large)
    return samples


def recovery_checks(only: str | None, samples: Samples) -> list[Check]:
    """The worker kills' checks of the topologies that ran, then one check per other recovery."""
    kills = samples.kills
    checks = kill_checks(kills.get("", {}), "") if only in (None, "kill") else []
    checks += kill_checks(kills.get(" on two nodes", {}), " on two nodes") if only in (None, "nodes-kill") else []
    checks += kill_checks(kills.get(ON_LARGE, {}), ON_LARGE) if only in (None, "kill-large") else []
    checks += [
        Check(what, value, target, "<=", why)
        for name, (what, target, why) in TARGETS.items()
        for value in getattr(samples, name)
    ]
    return checks


def main() -> None:
    a = parse_args()
    root = Path(a.workdir or tempfile.mkdtemp(prefix="pretrain-recovery-"))
    model = {"n_layer": a.layers, "n_head": 4, "d_model": a.d_model, "max_seq_len": 64}
    runs, kill_large = planned_runs(a.only, root, model)
    samples = run_campaigns(runs, kill_large)
    print(f"reference: {DLROVER}")
    report(recovery_checks(a.only, samples))


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
    recovered = ", ".join(f"{path} {sorted(times)}" for path, times in sorted(kills.items()))
    print(f"worker kills{where} recovered: {recovered}")
    return [
        Check(f"worker kill{where} → first step, fast path (median), s", fast, 1.0, "<=", why),
        Check(f"worker kill{where}: fast path / full restart (medians)", round(fast / restart, 3), 0.5, "<=", why),
    ]


if __name__ == "__main__":
    main()
