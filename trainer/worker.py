"""Worker entry point: ``python -m trainer.worker JOB.json`` (one process per rank).

Started by the node agent (``trainer.launch``); its command line names this module so an
operator can find the workers of a job with ``ps`` and signal them. With ``--spare N`` it is a
warm spare: it imports torch and builds the model ahead, then waits in the agent's store until
it is handed a lost rank (``trainer.resilience.peers``).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from dataclasses import replace

import torch
import torch.distributed as dist

from trainer.checkpoint.flash import finish_digests
from trainer.common.process import exit_when_orphaned
from trainer.dist import Identity, connect_store, init_distributed, pick_backend, shutdown_and_exit
from trainer.job.config import JobConfig
from trainer.job.events import EventKind, error_event
from trainer.job.reporting import JsonLines
from trainer.loop import build_model, seed_everything, train
from trainer.resilience.heartbeat import Heartbeat, collective_timeout_s
from trainer.resilience.nodecheck import this_node
from trainer.resilience.peers import Peers, arrive_as_replacement, exit_code, fast_recovery_bound_s, wait_for_rank
from trainer.resilience.stacks import dump_on_signal, stack_path

DIGEST_WAIT_S = 10.0  # the longest a failing worker waits for the digest of the snapshot it copied


def warm_up(cfg: JobConfig) -> tuple | None:
    """A spare's model and optimizer, built on the CPU as a fresh worker builds them (a fresh
    worker builds on the CPU too, then moves the model to its device). None under FSDP: its model
    is sharded over the process group, so it is built after joining."""
    if cfg.cluster.parallelism == "fsdp":
        return None
    seed_everything(cfg.seed, torch.device("cpu"))
    return build_model(cfg, torch.device("cpu"))


def placed(warm: tuple | None, cfg: JobConfig, me: Identity) -> tuple | None:
    """The spare's model on the device of the rank it took (the optimizer has no state yet: its
    parameters are moved in place)."""
    if warm is not None and pick_backend(cfg.cluster.backend) == "nccl":
        warm[0].to(torch.device("cuda", me.local_rank))
    return warm


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m trainer.worker")
    p.add_argument("job", help="job config JSON")
    p.add_argument("--shm", help="the node's shared-memory snapshot directory (flash checkpoints)")
    p.add_argument("--spare", type=int, help="a warm spare: wait for the agent to hand over a lost rank (spare id)")
    p.add_argument(
        "--round",
        type=int,
        help="the rendezvous round under torch's agent: the restart count the "
        "worker's keys in the job's store are named by (torch's own count stays the same in a round that "
        "only took a node in)",
    )
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    exit_when_orphaned()
    cfg = JobConfig.load(args.job)
    # OMP_NUM_THREADS from the agent counts too when this process was forked with torch imported
    # (trainer.zygote.client): torch read the variable when the zygote imported it
    threads = cfg.cluster.threads_per_worker or int(os.environ.get("OMP_NUM_THREADS") or 0)
    if threads:
        torch.set_num_threads(threads)
    code, me, bound_s = 0, Identity.from_env(), fast_recovery_bound_s()
    if args.round is not None:
        me = replace(me, restart_count=args.round)
    fast = bound_s > 0
    try:
        timeout_s = collective_timeout_s(cfg.fault_tolerance.phase_timeouts)
        # rank 0 hosts a round's own store; a spare (whose RANK is not its own yet) never does
        store = connect_store(timeout_s, me.rank if args.spare is None else -1) if fast else None
        warm = None
        if args.spare is not None:
            warm = warm_up(cfg)
            JsonLines(cfg.layout.events).write({"event": EventKind.SPARE_READY, "spare": args.spare})
            try:
                me = wait_for_rank(store, args.spare, this_node())
            except dist.DistError as err:  # the round's store went away (its rank 0 was lost): it was no rank yet
                print(
                    f"warm spare {args.spare}: the job's store went away before it took a rank ({err})",
                    file=sys.stderr,
                    flush=True,
                )
                shutdown_and_exit(1)
            warm = placed(warm, cfg, me)
        if fast and me.epoch > 0:  # a replacement: it meets the survivors, or gives up with them
            me = arrive_as_replacement(store, me, bound_s)
        heartbeat = Heartbeat(cfg.job_dir, me.local_rank, me.rank)
        dump_on_signal(stack_path(heartbeat.path))  # a hung worker's stacks, taken before it is killed
        heartbeat.beat("startup", 0)
        info = init_distributed(cfg.cluster.backend, timeout_s=timeout_s, me=me, base=store)
        peers = Peers.from_env(store, me, info.backend, timeout_s) if fast else None
        train(cfg, info, shm_ns=args.shm, heartbeat=heartbeat, warm=warm, peers=peers)
    except BaseException as err:  # noqa: BLE001 - report every failure, then exit non-zero
        traceback.print_exc()
        report = JsonLines(cfg.layout.events)
        report.write(error_event(err, rank=me.rank, traceback=traceback.format_exc()[-2000:]))
        finish_digests(DIGEST_WAIT_S)
        code = exit_code(err, fast)
    shutdown_and_exit(code)


if __name__ == "__main__":
    main()
