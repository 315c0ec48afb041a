"""This node's part of a job of several nodes: what ``torch.distributed.launcher.api.elastic_launch``
does, with our rendezvous (``trainer.agent.rendezvous_store``, ``trainer.agent.node_links``), the
first round gathering every node (``trainer.agent.first_round``), the survivors' agent
(``trainer.agent.survivors``) and the workers' output on the agent's own streams."""

from __future__ import annotations

import os

from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from trainer.agent.first_round import gather_nodes
from trainer.agent.node_links import NodeLinks
from trainer.agent.rendezvous_store import RoundStoreAddress
from trainer.agent.survivors import SurvivorsAgent


class ConsoleLogs(LogsSpecs):
    """The workers write to this node agent's stdout and stderr (which the job's launcher keeps),
    and nothing else: torch's ``DefaultLogsSpecs`` makes a ``torchelastic_*`` directory in the
    machine's temporary directory per launch, with one per round and rank under it, and never
    removes them (our workers leave no error files: they report their errors in the job's events)."""

    def __init__(self) -> None:
        super().__init__(log_dir=os.devnull)

    @property
    def root_log_dir(self) -> str:
        return os.devnull

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        console = dict.fromkeys(envs, "")  # "": the agent's own stream
        return LogsDest(stdouts=console, stderrs=dict(console), error_files=dict.fromkeys(envs, os.devnull))


def launch(
    *,
    min_nodes: int,
    max_nodes: int,
    nproc: int,
    run_id: str,
    endpoint: str,
    rdzv_configs: dict,
    max_restarts: int,
    command: list[str],
    fast_timeout_s: float,
    spares: int = 0,
    node: int = 0,
    spares_wanted=lambda: True,
    monitor_interval: float = 0.2,
    first_round_wait_s: float | None = 0.0,
    before_round=lambda: None,
) -> bool:
    """This node's part of the job (what ``torch.distributed.launcher.api.elastic_launch`` does,
    with ``SurvivorsAgent`` keeping ``spares`` warm spares once ``spares_wanted()``; the first
    round waits up to ``first_round_wait_s`` for all ``max_nodes`` nodes; None: a standby node,
    which neither checks in nor waits; ``before_round()`` runs before every round this node joins);
    raises ``ChildFailedError`` when the job failed; False when this node stood by as the job ended
    (torch's agent left the closed rendezvous gracefully), else True."""
    params = RendezvousParameters(
        backend="c10d", endpoint=endpoint, run_id=run_id, min_nodes=min_nodes, max_nodes=max_nodes, **rdzv_configs
    )
    rendezvous = RoundStoreAddress(rdzv_registry.get_rendezvous_handler(params), NodeLinks(node))  # (store up now)
    if first_round_wait_s is not None:
        gather_nodes(endpoint, run_id, max_nodes, first_round_wait_s, node)
    spec = WorkerSpec(
        role="trainer",
        local_world_size=nproc,
        entrypoint=command[0],
        args=tuple(command[1:]),
        rdzv_handler=rendezvous,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
    )
    agent = SurvivorsAgent(
        spec, fast_timeout_s, spares, node, spares_wanted, before_round, logs_specs=ConsoleLogs(), start_method="spawn"
    )
    shutdown_rendezvous = True
    try:
        result = agent.run()
        rendezvous.links.close()  # the job ended here: not a lost node to the others
        if result is None:  # torch's agent left gracefully: this node stood by when the job's rendezvous closed
            return False
        if result.is_failed():
            raise ChildFailedError(name=command[0], failures=result.failures)
        return True
    except ChildFailedError:
        raise
    except SignalException:
        shutdown_rendezvous = False  # stopped by a signal: the rendezvous stays open for the other nodes (as torch's)
        raise
    finally:
        if shutdown_rendezvous:
            spec.rdzv_handler.shutdown()
