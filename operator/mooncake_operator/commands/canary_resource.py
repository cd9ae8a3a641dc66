"""`mooncake-operator canary --resource [NAMESPACE/]NAME`: the canary as the operator would run it.

The resource says what to prove (request, expectations, pairs, block size, Eagle, port, replicas) and
which replica set serves users (`status.rollout.servingSet`); the config is built by the operator's own
`canary_policy.canary_config`, so `helm test` and the operator never disagree about what a proof is.
Everything here but `fetch_serving` is pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from mooncake_operator import api, canary_policy, render
from mooncake_operator.api import InvalidResourceError, MooncakeServing
from mooncake_operator.canary import CanaryConfig, CanaryResult
from mooncake_operator.kube import KubeApiError, KubeClient, KubeTransportError

DEFAULT_NAMESPACE = "default"


class ResourceError(Exception):
    """The resource cannot be read or proven; the message says why and what to change."""


@dataclass(frozen=True)
class ResourceRef:
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def parse_ref(text: str, default_namespace: str | None) -> ResourceRef:
    """NAMESPACE/NAME, or NAME in `default_namespace` (the kubeconfig's or the pod's), else `default`."""
    namespace, slash, name = text.rpartition("/")
    if not name or (slash and not namespace) or "/" in namespace:
        raise ResourceError(f"--resource {text!r}: give NAME or NAMESPACE/NAME")
    return ResourceRef(namespace or default_namespace or DEFAULT_NAMESPACE, name)


def serving_set(resource: MooncakeServing) -> str:
    """The replica StatefulSet that serves users: the one the status records (a BlueGreen switch names
    NAME-r<hex>), else NAME-replica. A candidate being proven beside it is not the serving set."""
    rollout = resource.status.rollout if resource.status is not None else None
    if rollout is not None and rollout.serving_set:
        return rollout.serving_set
    return render.replica_set_name(resource)


@dataclass(frozen=True)
class ResourceCanary:
    """What `canary --resource` runs: the serving set's URLs in the operator's config, and how the
    operator reads the verdict (`requireExternalHit`)."""

    serving_set: str
    config: CanaryConfig
    require_external_hit: bool
    notes: tuple[str, ...] = ()


def resource_canary(resource: MooncakeServing) -> ResourceCanary:
    """The run that proves `resource`'s serving set, exactly as the operator configures its canary."""
    set_name = serving_set(resource)
    urls = render.replica_urls(resource, set_name)
    try:
        config = canary_policy.canary_config(resource.spec, urls)
    except ValidationError as error:  # e.g. spec.replicas 1 (a resource with the canary off)
        problems = "; ".join(api.describe_validation_error(error))
        raise ResourceError(f"MooncakeServing {_ref(resource)} cannot be proven: {problems}") from None
    notes: list[str] = []
    rollout = resource.status.rollout if resource.status is not None else None
    if rollout is not None and rollout.candidate_set and rollout.candidate_set != set_name:
        # The spec describes the candidate; the serving set still runs the revision before it.
        notes.append(
            f"candidate set {rollout.candidate_set} is being rolled out ({rollout.candidate_phase}); "
            f"proving the serving set {set_name} with the spec's canary settings"
        )
    return ResourceCanary(
        serving_set=set_name,
        config=config,
        require_external_hit=resource.spec.canary.require_external_hit,
        notes=tuple(notes),
    )


def effective_result(result: CanaryResult, *, require_external_hit: bool) -> CanaryResult:
    """The result with the verdict the operator would record (`canary_policy.effective_verdict`), so the
    report and the exit status say what the operator's status would."""
    verdict = canary_policy.effective_verdict(result, require_external_hit=require_external_hit)
    if verdict is result.verdict:
        return result
    reason = f"passed without a proven external hit (requireExternalHit: false): {result.reason}"
    return result.model_copy(update={"verdict": verdict, "reason": reason})


async def fetch_serving(kube: KubeClient, ref: ResourceRef) -> MooncakeServing:
    """GET and validate the MooncakeServing; ResourceError with the reason (never the raw traceback)."""
    try:
        body = await kube.get(api.API_VERSION, api.KIND, ref.name, ref.namespace)
    except KubeApiError as error:
        raise ResourceError(_api_error(error, ref)) from None
    except KubeTransportError as error:
        raise ResourceError(f"cannot reach the API server: {error}") from None
    try:
        return api.parse_resource(body)
    except InvalidResourceError as error:
        raise ResourceError(f"MooncakeServing {ref} is invalid: {'; '.join(error.problems)}") from None


def _api_error(error: KubeApiError, ref: ResourceRef) -> str:
    plural = f"{api.PLURAL}.{api.GROUP}"
    if error.status == 404:
        return f"MooncakeServing {ref} not found (or the {plural} API is not installed): {error.message}"
    if error.status == 401:
        return f"the API server did not accept the credentials (401): {error.message}"
    if error.status == 403:
        return (
            f"not allowed to get {plural} in namespace {ref.namespace} (403; the chart's test Role "
            f"grants it): {error.message}"
        )
    return f"reading MooncakeServing {ref} failed: {error}"


def _ref(resource: MooncakeServing) -> str:
    return f"{resource.metadata.namespace}/{resource.metadata.name}"
