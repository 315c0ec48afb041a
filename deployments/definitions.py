"""What the deployments are — names, entrypoints, parameters, limits, the evaluation trigger — in
one place for ``deployments.serve`` and ``deployments.deploy`` (``prefect.yaml`` says the same in
YAML; tests keep them equal)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefect.events import DeploymentEventTrigger

from tasks.events import CHECKPOINT_GOOD, FINAL_LABEL


@dataclass(frozen=True)
class Definition:
    name: str
    entrypoint: str
    description: str
    tags: list[str]
    parameters: dict = field(default_factory=dict)
    concurrency_limit: int | None = None


def campaign(spec_path: str = "builtin:tiny") -> Definition:
    # one run at a time: runs of one spec share a workdir (the flow's workdir lock backs this up)
    return Definition(
        "pretrain-campaign",
        "flows/campaign.py:pretrain_campaign",
        "Run (or resume) an LLM pre-training campaign from a campaign spec.",
        ["pretrain"],
        {"spec_path": spec_path},
        concurrency_limit=1,
    )


def prepare_data(spec_path: str = "builtin:tiny") -> Definition:
    return Definition(
        "prepare-data",
        "flows/prepare_data.py:prepare_data",
        "Train the tokenizer and pack token shards for a campaign (idempotent).",
        ["pretrain", "data"],
        {"spec_path": spec_path},
    )


def evaluate_checkpoint() -> Definition:
    return Definition(
        "evaluate-checkpoint",
        "flows/evaluate_checkpoint.py:evaluate_checkpoint",
        "Evaluate one checkpoint (path or s3:// URI) on a campaign's validation data.",
        ["pretrain", "evaluation"],
    )


def compare_campaigns() -> Definition:
    return Definition(
        "compare-campaigns",
        "flows/compare.py:compare_campaigns",
        "Compare campaigns from MLflow (eval loss, tokens, goodput, faults, differing parameters) "
        "as a markdown artifact.",
        ["pretrain", "tracking"],
    )


def evaluate_on_good_checkpoint() -> DeploymentEventTrigger:
    """Run the evaluation deployment for each stage's final checkpoint once it passed
    validation, in any campaign."""
    return DeploymentEventTrigger(
        enabled=True,
        match={"prefect.resource.id": "pretrain.campaign.*", FINAL_LABEL: "true"},
        expect={CHECKPOINT_GOOD},
        parameters={"checkpoint": "{{ event.payload.checkpoint }}", "data_dir": "{{ event.payload.data_dir }}"},
    )
