"""``pretrain cluster``: review what a campaign would create on its cluster before anything runs."""

from __future__ import annotations

import typer

from pretrain.cli.errors import fail

cluster_app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Review a campaign's cluster: the Kubernetes manifests of a stage."
)


@cluster_app.command("render")
def render(
    spec: str = typer.Argument(..., help="Campaign spec YAML with cluster.kind: kubernetes."),
    stage: str | None = typer.Option(None, "--stage", help="Stage to render (default: the first)."),
    attempt: int = typer.Option(1, "--attempt", min=1, help="Launch attempt of the stage (names and labels carry it)."),
    vocab_size: int | None = typer.Option(
        None,
        "--vocab-size",
        min=1,
        help="Vocabulary of the data set (sizes /dev/shm); default: the spec's tokenizer vocab_size.",
    ),
) -> None:
    """Print the manifests (headless Service, Indexed Job) the Kubernetes backend would create for a stage
    launch, as multi-document YAML: secrets appear by reference only. Review them or hand them to GitOps."""
    import yaml

    from pretrain.cluster.kube.manifests import stage_launch
    from pretrain.spec.campaign import SpecError
    from pretrain.spec.file import load_spec

    try:
        campaign = load_spec(spec)
    except SpecError as e:
        raise fail(str(e))
    if campaign.blocks.cluster:
        raise fail(
            f"{spec} names its cluster by block ({campaign.blocks.cluster}): render needs the cluster section "
            "inline (cluster.kind: kubernetes with a kubernetes section)"
        )
    if campaign.cluster.kind != "kubernetes":
        raise fail(
            f"{spec}: cluster.kind is {campaign.cluster.kind!r}; only kind 'kubernetes' has manifests "
            "(set cluster.kind: kubernetes and a cluster.kubernetes section with at least image)"
        )
    try:
        launch = stage_launch(campaign, stage or campaign.stages[0].name, attempt, vocab_size)
        docs = launch.manifests()
    except KeyError as e:
        raise fail(f"{spec}: {e.args[0]}")
    except ValueError as e:
        raise fail(f"{spec}: {e}")
    typer.echo(yaml.safe_dump_all(docs, sort_keys=False), nl=False)
