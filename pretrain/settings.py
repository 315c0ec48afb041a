"""Orchestrator knobs that are not campaign settings: how long to wait, how often to poll.

A campaign spec says what to train and how it must behave; these say how patient this process
is with the processes it starts (gate, workers, MLflow). They differ per machine, not per
campaign, so they are read from the environment — ``PRETRAIN_<FIELD>``, e.g.
``PRETRAIN_GATE_POLL_S=30`` — as Prefect's own integrations read theirs. Not a global: each
entry point builds one (``PretrainSettings.from_env()``) and passes it down.
"""

from __future__ import annotations

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "PRETRAIN_"


class SettingsError(ValueError):
    """A ``PRETRAIN_*`` environment variable holds a value its knob cannot take."""


class PretrainSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore")

    gate_poll_s: float = Field(
        10.0,
        gt=0,
        description="While a job trains, the validation gate judges newly committed checkpoints (all "
        "pending at once) every this many seconds.",
    )
    gate_timeout_floor_s: float = Field(
        600.0,
        gt=0,
        description="A gate process (torch import, probe, evaluation) gets at least this long before "
        "its checkpoints count as unjudged (judged again on the next pass).",
    )
    gate_per_request_s: float = Field(
        60.0, ge=0, description="… plus this per checkpoint it judges (loading, probing, evaluating it)."
    )
    gate_min_bytes_per_s: float = Field(
        20 * 2**20,
        gt=0,
        description="… plus the checkpoints' bytes at this rate, twice (every shard is hashed, then loaded).",
    )
    prefect_outage_s: float = Field(
        600.0,
        ge=0,
        description="A stage whose job ended while the Prefect API does not answer waits this long for "
        "it before the stage's flow run ends (its end is a request to the API); then the run fails and the same "
        "command resumes.",
    )
    job_poll_s: float = Field(
        1.0, gt=0, description="How often the training task looks at its job: exit codes, lost nodes, new metrics."
    )
    stop_grace_s: float = Field(
        120.0,
        ge=0,
        description="An operator's stop (Ctrl-C, SIGTERM) waits this long for the savers' save at "
        "breakpoint before the job's processes are killed.",
    )
    kill_grace_s: float = Field(
        30.0,
        gt=0,
        description="How long the infrastructure that runs a deployment's flow-run process waits between "
        "its SIGTERM and its SIGKILL: Prefect 3's process worker and `serve` runner wait 30 s on a cancellation (fixed "
        "in Prefect), Kubernetes the pod's terminationGracePeriodSeconds (30 s unless the job template raises it). A "
        "SIGTERM there pauses the campaign within this less 5 s (and never longer than resume.grace_period_s); "
        "past that everything stops at once.",
    )
    scale_up_grace_s: float = Field(
        120.0, ge=0, description="A job stopped to scale back up waits this long for the savers' final persist."
    )
    mlflow_drain_s: float = Field(
        120.0,
        ge=0,
        description="After a job, metrics still waiting for MLflow (an outage) get this long to reach "
        "it; what is left stays in the job's metrics.jsonl.",
    )
    forwarder_backoff_s: float = Field(
        1.0,
        gt=0,
        description="While MLflow is away, the metrics forwarder's first wait before trying again; "
        "doubles with each failure in a row.",
    )
    forwarder_backoff_max_s: float = Field(
        60.0, gt=0, description="The longest wait of the metrics forwarder between tries."
    )
    health_check_timeout_s: float = Field(
        180.0,
        gt=0,
        description="A node health-check process (matmul timing, allreduce) that takes longer fails the check.",
    )
    progress_interval_s: float = Field(
        30.0,
        gt=0,
        description="While a stage trains, a progress line (step / total, loss, tokens/s, ETA, restarts, "
        "newest checkpoint) goes to the flow run's log, and to the console when it is not a terminal, every this "
        "many seconds.",
    )
    node_lock_wait_s: float = Field(
        30.0,
        gt=0,
        description="A node agent waits this long for its predecessor on the node (a dying agent of "
        "the previous launch) to let go of the node's lock.",
    )
    node_silent_s: float = Field(
        20.0,
        ge=0,
        description="On the local cluster, a node whose agent gave no sign of life (its liveness file, "
        "refreshed every second) for this long is stopped and counts as lost: a frozen node neither exits nor "
        "closes its sockets. Its rendezvous drops it sooner (cluster.node_timeout_s); this only ends the process "
        "the job would otherwise wait for. 0: never.",
    )
    lease_ttl_s: float = Field(
        60.0,
        gt=0,
        description="A campaign whose state is on shared storage (`checkpoint.state_uri`) is held by a "
        "lease its run renews every third of this; a run that died loses it this long (plus the margin) after.",
    )
    lease_margin_s: float = Field(
        10.0,
        ge=0,
        description="… plus this, for clock skew between machines: another run takes the lease over "
        "only this long after it expired.",
    )

    @classmethod
    def from_env(cls) -> PretrainSettings:
        """The settings of this process's environment; a bad value is a :class:`SettingsError`
        naming the variable and what to do."""
        try:
            return cls()
        except ValidationError as err:
            problems = "; ".join(
                f"{ENV_PREFIX}{'_'.join(map(str, e['loc'])).upper()}={e.get('input')!r}: {e['msg']}"
                for e in err.errors()
            )
            raise SettingsError(
                f"invalid environment variable(s): {problems}. Fix or unset them "
                "(the defaults are in pretrain/settings.py)."
            ) from None
