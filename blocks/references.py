"""A campaign spec may name saved blocks (``blocks: {storage: ..., cluster: ..., tracking: ...}``)
instead of giving those settings inline; this turns the references into an inline spec."""

from __future__ import annotations

from pathlib import Path

from prefect.blocks.core import Block

from blocks.cluster import KubernetesCluster, LocalProcessCluster
from blocks.storage import LocalCampaignStorage, S3CampaignStorage
from blocks.tracking import MlflowTracking
from pretrain.cluster.local import not_runnable
from pretrain.credentials import Credentials
from pretrain.spec.campaign import CampaignSpec, SpecError, parse_spec
from pretrain.spec.file import resolve_spec

KINDS: dict[str, tuple[type[Block], ...]] = {
    "storage": (LocalCampaignStorage, S3CampaignStorage),
    "cluster": (LocalProcessCluster, KubernetesCluster),
    "tracking": (MlflowTracking,),
}


def load_block(field: str, ref: str) -> Block:
    """The saved block ``ref`` ('<block-type-slug>/<name>') that ``blocks.<field>`` names."""
    slugs = " or ".join(f"'{k.get_block_type_slug()}/<name>'" for k in KINDS[field])
    slug, _, name = ref.partition("/")
    if not slug or not name:
        raise SpecError(f"blocks.{field}: {ref!r} must name a saved block as {slugs}")
    try:
        block = Block.load(ref)
    except (ValueError, KeyError) as err:
        raise SpecError(
            f"blocks.{field}: cannot load block {ref!r} ({err}). Create it in the Prefect UI or with "
            "`<Block>(...).save(name)`; register the block types once with `prefect block register -m blocks`"
        ) from None
    if not isinstance(block, KINDS[field]):
        raise SpecError(f"blocks.{field}: {ref!r} is a {type(block).__name__} block; expected {slugs}")
    return block


def _merge(body: dict, update: dict) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(body.get(key), dict):
            _merge(body[key], value)
        else:
            body[key] = value


def apply_blocks(spec: CampaignSpec) -> CampaignSpec:
    """The spec with its block references replaced by the blocks' settings (and ``blocks`` emptied, so
    it resolves once), the environment the blocks' credentials need attached as ``spec.credentials``.
    A workdir that was set by an override (``--workdir``) wins over the storage block's."""
    if not spec.blocks.any():
        return spec
    body = spec.model_dump(mode="json")
    body["blocks"] = {}
    env: dict[str, str] = {}
    overridden = spec.workdir != CampaignSpec.model_fields["workdir"].default
    for field in KINDS:
        ref = getattr(spec.blocks, field)
        if not ref:
            continue
        block = load_block(field, ref)
        try:
            update = block.spec_update(spec.name)
        except ValueError as err:
            raise SpecError(f"blocks.{field}: {err}") from None
        if overridden:
            update.pop("workdir", None)
        _merge(body, update)
        env.update(block.environment())
    resolved = parse_spec(body, f"{spec.name} (with blocks {spec.blocks.model_dump(exclude_none=True)})")
    return resolved.with_credentials(Credentials(env))


def resolve_campaign(
    spec: CampaignSpec | None = None, spec_path: str | None = None, workdir: str | Path | None = None
) -> CampaignSpec:
    """The spec a flow was given (inline, ``spec_path`` or the built-in demo) with its block
    references resolved; ``workdir`` overrides where the campaign keeps its state. The blocks'
    credentials travel with the returned spec in this process's memory (``spec.credentials``):
    child processes get them through their environment, S3 and MLflow clients as arguments;
    this process's environment is left alone, so no other campaign (under ``deployments.serve``)
    ever sees them."""
    resolved = apply_blocks(resolve_spec(spec, spec_path)).with_workdir(workdir)
    if why := not_runnable(resolved.cluster):
        raise SpecError(why)
    return resolved
