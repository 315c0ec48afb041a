"""The chaos drills of a campaign spec (``chaos``): one model per kind, each with only its own
fields; ``kind`` picks the model (:data:`ChaosDrill`)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Discriminator, Field, Tag

from pretrain.spec.base import Section


class _Drill(Section):
    stage: str | None = Field(None, description="Stage in which the drill fires (default: the first stage).")
    step: int = Field(
        1,
        ge=1,
        description="Fires when training reaches this step of the stage (once per stage, never again after the "
        "restart).",
    )


class _WorkerDrill(_Drill):
    rank: int = Field(0, ge=0, description="Global rank of the worker the drill acts on.")


class _NodeDrill(_Drill):
    node: int = Field(0, ge=0, description="Index of the node the drill acts on.")


class KillWorker(_WorkerDrill):
    kind: Literal["kill_worker"] = Field(
        description="SIGKILL the worker at `step`: its node's agent restarts the workers from the newest memory "
        "snapshot."
    )


class HangWorker(_WorkerDrill):
    kind: Literal["hang_worker"] = Field(
        description="The worker stops making progress at `step`: the hang detector must restart the workers."
    )


class NanLoss(_WorkerDrill):
    kind: Literal["nan_loss"] = Field(
        description="The worker's loss at `step` is NaN: the step is rolled back and its samples skipped."
    )


class LossSpike(_WorkerDrill):
    kind: Literal["loss_spike"] = Field(
        description="The worker's loss at `step` is multiplied by `factor`: the spike detector rolls it back."
    )
    factor: float = Field(20.0, gt=1, description="What the loss of that step is multiplied by.")


class SlowWorker(_WorkerDrill):
    kind: Literal["slow_worker"] = Field(
        description="The worker is a straggler from `step` on (no marker: every step), and its node check is slowed "
        "too."
    )
    delay_s: float = Field(
        0.2,
        ge=0,
        description="Extra seconds per step from `step` on, and a proportional slowdown of its node check (the one "
        "before training if `step` is 1, else the one after the next restart).",
    )


class KillSaver(_NodeDrill):
    kind: Literal["kill_saver"] = Field(
        description="Kill the node's checkpoint saver at `step`: the agent restarts it; training goes on meanwhile."
    )


class KillNode(_NodeDrill):
    kind: Literal["kill_node"] = Field(
        description="Kill the whole node (agent, workers, saver) at `step`: training goes on without it (elastic) "
        "and it rejoins after `cluster.rejoin_after_s`."
    )


class FreezeNode(_NodeDrill):
    kind: Literal["freeze_node"] = Field(
        description="Freeze the whole node (SIGSTOP to agent, workers, saver) at `step`, as a hung machine: nothing "
        "exits and no socket closes. The rendezvous drops it once its keep-alives lapse (`cluster.node_timeout_s`) and "
        "training goes on without it; the orchestrator stops it for good once its agent has been silent for "
        "`PRETRAIN_NODE_SILENT_S` (local cluster)."
    )


class CorruptCheckpoint(_Drill):
    kind: Literal["corrupt_checkpoint"] = Field(
        description="Flip one byte of the model state of the checkpoint persisted at `step` (silent storage "
        "corruption: the validation gate must catch it)."
    )


DRILL_KINDS = {
    m.model_fields["kind"].annotation.__args__[0]: m
    for m in (
        KillWorker,
        HangWorker,
        NanLoss,
        LossSpike,
        SlowWorker,
        KillSaver,
        KillNode,
        FreezeNode,
        CorruptCheckpoint,
    )
}


def _drill_kind(value) -> str | None:
    return value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)


ChaosDrill = Annotated[
    Union[tuple(Annotated[model, Tag(kind)] for kind, model in DRILL_KINDS.items())],  # noqa: UP007 - built at run time
    Discriminator(
        _drill_kind,
        custom_error_type="drill_kind",
        custom_error_message=f"`kind` must be one of {', '.join(DRILL_KINDS)}",
    ),
]
