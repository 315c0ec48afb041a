"""Check a Kubernetes cluster before any training: the API answers, the namespace exists, and the
credentials in use may do everything the backend does (one ``SelfSubjectAccessReview`` per verb
of :data:`pretrain.cluster.kube.rbac.REQUIRED`, as ``kubectl auth can-i`` does). Every problem found is
reported at once, in one message that says what to apply or fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import yaml

from pretrain.cluster.kube.rbac import REQUIRED, Access, role_rules
from pretrain.cluster.local import ClusterError


class PreflightError(ClusterError):
    """The cluster cannot run the campaign as configured; the message says what to fix."""


@dataclass
class Preflight:
    """What the checks found (``problems`` empty: the cluster is ready)."""

    server: str
    namespace: str
    problems: list[str] = field(default_factory=list)
    denied: list[Access] = field(default_factory=list)  # (resource, the verbs denied)
    notes: list[str] = field(default_factory=list)  # could not be checked, but not an error

    @property
    def ok(self) -> bool:
        return not self.problems

    def message(self) -> str:
        head = f"Kubernetes preflight of namespace {self.namespace!r} at {self.server} failed: "
        return head + "; ".join(self.problems)

    def raise_if_failed(self) -> None:
        if self.problems:
            raise PreflightError(self.message())


def _api_reason(e) -> str:
    """The API's own message of an ApiException (its body is a Status), else the HTTP phrase."""
    try:
        return json.loads(e.body).get("message") or str(e.reason)
    except (TypeError, ValueError, AttributeError):
        return str(e.reason)


def _unreachable(server: str, e: Exception) -> str:
    return (
        f"the Kubernetes API at {server} does not answer ({type(e).__name__}: {str(e)[:200]}): check the "
        "kubeconfig (KUBECONFIG, its current context) or, in a pod, that the API server is reachable"
    )


def _can(authz, namespace: str, group: str, resource: str, verb: str) -> bool:
    from kubernetes import client

    plural, _, sub = resource.partition("/")
    attrs = client.V1ResourceAttributes(
        namespace=namespace, group=group, resource=plural, verb=verb, subresource=sub or None
    )
    review = authz.create_self_subject_access_review(
        client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=attrs))
    )
    return bool(review.status and review.status.allowed)


def _rbac_hint(namespace: str, denied: list[Access]) -> str:
    rules = yaml.safe_dump(role_rules(denied), default_flow_style=True, width=1000).strip()
    return (
        f"apply the orchestrator's RBAC (`python -m pretrain.cluster.kube.rbac {namespace} | kubectl apply -f -`, "
        "deploy/kubernetes/rbac.yaml) and run the flow as its service account prefect-pretrain, or grant "
        f"these Role rules in namespace {namespace!r}: {rules}"
    )


def preflight(api, namespace: str) -> Preflight:
    """Run every check with ``api`` (a ``kubernetes.client.ApiClient``); never raises for what the
    cluster answers — the returned :class:`Preflight` lists the problems."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    result = Preflight(api.configuration.host, namespace)
    try:
        client.CoreV1Api(api).read_namespace(namespace)
    except ApiException as e:
        if e.status == 401:
            result.problems.append(
                f"the API rejected the credentials ({_api_reason(e)}): renew the token or "
                "certificate of the kubeconfig's user"
            )
            return result
        if e.status == 404:
            result.problems.append(
                f"namespace {namespace!r} does not exist: create it (`kubectl create namespace "
                f"{namespace}`) or set cluster.kubernetes.namespace to an existing one"
            )
            return result
        # 403 and others: reading namespaces is cluster-scoped, a namespaced Role cannot grant it
        result.notes.append(
            f"could not read namespace {namespace!r} ({e.status} {_api_reason(e)}); checking access in it anyway"
        )
    except Exception as e:  # connection refused, DNS, TLS: the API is not there
        result.problems.append(_unreachable(result.server, e))
        return result
    authz = client.AuthorizationV1Api(api)
    try:
        for need in REQUIRED:
            verbs = tuple(v for v in need.verbs if not _can(authz, namespace, need.group, need.resource, v))
            if verbs:
                result.denied.append(Access(need.group, need.resource, verbs))
    except ApiException as e:
        result.problems.append(
            f"the API refused a SelfSubjectAccessReview ({e.status} {_api_reason(e)}): the "
            "credentials cannot even check their own access; use an account bound to the "
            "cluster's default system:basic-user role"
        )
        return result
    except Exception as e:
        result.problems.append(_unreachable(result.server, e))
        return result
    if result.denied:
        missing = ", ".join(f"{'/'.join(a.verbs)} {a.name}" for a in result.denied)
        result.problems.append(f"the credentials in use may not {missing}; {_rbac_hint(namespace, result.denied)}")
    return result


def manifests_markdown(spec, vocab_size: int | None = None) -> str:
    """The manifests of every stage's first launch (as ``pretrain cluster render`` prints them), as
    markdown for review; PreflightError when a stage cannot be rendered (e.g. /dev/shm exceeds the
    pod's memory): a configuration error, found before anything starts."""
    from pretrain.cluster.kube.manifests import stage_launch

    parts = [
        f"# Kubernetes manifests of campaign {spec.name}\n\nSecrets appear by reference only. "
        "Later attempts differ in names and the attempt label; `pretrain cluster render SPEC --stage NAME "
        "--attempt N` prints any of them.\n"
    ]
    for stage in spec.stages:
        try:
            docs = stage_launch(spec, stage.name, 1, vocab_size).manifests()
        except ValueError as e:
            raise PreflightError(f"stage {stage.name!r}: {e}") from None
        parts.append(f"## Stage {stage.name}\n\n```yaml\n{yaml.safe_dump_all(docs, sort_keys=False)}```\n")
    return "\n".join(parts)
