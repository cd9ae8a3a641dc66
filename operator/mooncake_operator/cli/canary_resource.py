"""`mooncake-operator canary --resource [NAMESPACE/]NAME`: the canary as the operator would run it.

The resource says what to prove (request, expectations, pairs, block size, Eagle, port, replicas) and
which replica set serves users (`status.rollout.servingSet`); the config is built by the operator's own
`canary.policy.canary_config`, so `helm test` and the operator never disagree about what a proof is.
The pods it dials are proven to be the resource's own, as the operator proves them: the serving set's
StatefulSet is controlled by the MooncakeServing (UID checked) and each pod by that StatefulSet (UID
checked); inside the cluster each is reached at its pod IP, never by a DNS name another pod with the same
hostname and subdomain could answer for. Everything here but the `fetch_` functions is pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from mooncake_operator.api.base import describe_validation_error
from mooncake_operator.api.group import API_VERSION, GROUP, KIND, PLURAL
from mooncake_operator.api.resource import InvalidResourceError, MooncakeServing, parse_resource
from mooncake_operator.build.names import (
    replica_pod_names,
    replica_selector_string,
    replica_set_name,
    replica_urls,
)
from mooncake_operator.build.ownership import controlled_by
from mooncake_operator.canary import policy
from mooncake_operator.canary.models import CanaryConfig, CanaryResult
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.kube.errors import KubeApiError, KubeTransportError

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
    return replica_set_name(resource)


@dataclass(frozen=True)
class ResourceCanary:
    """What `canary --resource` runs: the operator's config for the serving set (its replicas are the
    set's DNS names; a run dials the proven pods instead, `fetch_replica_pods`), and how the operator
    reads the verdict (`requireExternalHit`)."""

    serving_set: str
    config: CanaryConfig
    require_external_hit: bool
    notes: tuple[str, ...] = ()


def resource_canary(resource: MooncakeServing) -> ResourceCanary:
    """The run that proves `resource`'s serving set, exactly as the operator configures its canary."""
    set_name = serving_set(resource)
    urls = replica_urls(resource, set_name)
    try:
        config = policy.canary_config(resource.spec, urls)
    except ValidationError as error:  # e.g. spec.replicas 1 (a resource with the canary off)
        problems = "; ".join(describe_validation_error(error))
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


@dataclass(frozen=True)
class ReplicaPod:
    """A replica pod proven to be the resource's own: its name and IP (None: not assigned yet)."""

    name: str
    ip: str | None

    def url(self, port: int) -> str:
        if not self.ip:
            raise ResourceError(f"replica pod {self.name} has no IP yet: wait for it to start")
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"http://{host}:{port}"


def proven_replica_pods(
    resource: MooncakeServing,
    set_name: str,
    stateful_set: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]],
) -> list[ReplicaPod]:
    """The serving set's pods in ordinal order, each one the StatefulSet `set_name` created, which this
    MooncakeServing controls (UIDs checked). ResourceError when the set is not the resource's or a pod
    is missing: a pod that only carries the labels, the name or the hostname is never dialled."""
    namespace = resource.metadata.namespace
    if stateful_set is None:
        raise ResourceError(
            f"StatefulSet {namespace}/{set_name} of MooncakeServing {_ref(resource)} not found"
        )
    if not controlled_by(stateful_set, KIND, resource.metadata.uid):
        raise ResourceError(
            f"StatefulSet {namespace}/{set_name} is not controlled by MooncakeServing {_ref(resource)} "
            f"(UID {resource.metadata.uid}): its pods are not proven"
        )
    set_uid = (stateful_set.get("metadata") or {}).get("uid")
    found = {}
    for pod in pods:
        metadata = pod.get("metadata") or {}
        if controlled_by(pod, "StatefulSet", set_uid) and not metadata.get("deletionTimestamp"):
            found[str(metadata.get("name"))] = (pod.get("status") or {}).get("podIP") or None
    names = replica_pod_names(resource, set_name)
    missing = [name for name in names if name not in found]
    if missing:
        raise ResourceError(
            f"replica pod(s) {', '.join(missing)} not found among the pods StatefulSet {set_name} created "
            "(controller reference, UID checked): wait for the rollout; a pod of that name that the "
            "StatefulSet did not create is never proven"
        )
    return [ReplicaPod(name, found[name]) for name in names]


def pod_urls(pods: Sequence[ReplicaPod], port: int) -> list[str]:
    """Each proven pod's URL at its IP; ResourceError when one has none yet or two share one (pods on
    the node's network, one node): a run needs one address per replica."""
    urls = [pod.url(port) for pod in pods]
    shared = sorted({url for url in urls if urls.count(url) > 1})
    if shared:
        raise ResourceError(f"replica pods share an address ({', '.join(shared)}): each must have its own")
    return urls


async def fetch_replica_pods(kube: KubeClient, resource: MooncakeServing, set_name: str) -> list[ReplicaPod]:
    """The serving set's StatefulSet and the resource's replica pods from the API server, proven."""
    namespace = resource.metadata.namespace
    try:
        stateful_set = await kube.get_or_none("apps/v1", "StatefulSet", set_name, namespace)
        pods = await kube.list("v1", "Pod", namespace, label_selector=replica_selector_string(resource))
    except KubeApiError as error:
        if error.status == 403:
            raise ResourceError(
                f"not allowed to get statefulsets.apps or list pods in namespace {namespace} (403; the "
                f"canary proves the pods it dials are the resource's own; the chart's test Role grants "
                f"both): {error.message}"
            ) from None
        raise ResourceError(f"reading the replica pods of {_ref(resource)} failed: {error}") from None
    except KubeTransportError as error:
        raise ResourceError(f"cannot reach the API server: {error}") from None
    return proven_replica_pods(resource, set_name, stateful_set, pods)


def effective_result(result: CanaryResult, *, require_external_hit: bool) -> CanaryResult:
    """The result with the verdict the operator would record (`canary.policy.effective_verdict`), so the
    report and the exit status say what the operator's status would."""
    verdict = policy.effective_verdict(result, require_external_hit=require_external_hit)
    if verdict is result.verdict:
        return result
    reason = f"passed without a proven external hit (requireExternalHit: false): {result.reason}"
    return result.model_copy(update={"verdict": verdict, "reason": reason})


async def fetch_serving(kube: KubeClient, ref: ResourceRef) -> MooncakeServing:
    """GET and validate the MooncakeServing; ResourceError with the reason (never the raw traceback)."""
    try:
        body = await kube.get(API_VERSION, KIND, ref.name, ref.namespace)
    except KubeApiError as error:
        raise ResourceError(_api_error(error, ref)) from None
    except KubeTransportError as error:
        raise ResourceError(f"cannot reach the API server: {error}") from None
    try:
        return parse_resource(body)
    except InvalidResourceError as error:
        raise ResourceError(f"MooncakeServing {ref} is invalid: {'; '.join(error.problems)}") from None


def _api_error(error: KubeApiError, ref: ResourceRef) -> str:
    plural = f"{PLURAL}.{GROUP}"
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
