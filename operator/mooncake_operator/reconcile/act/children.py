"""Applying children: server-side apply under one field manager, only when something would change.

A child is written when it is missing, when its `applied-hash` annotation (a digest of the rendered
manifest) differs from the freshly rendered one (the spec changed, including fields that were removed),
or when a field the operator sets no longer holds the rendered value (someone edited it: drift). The live
children come from the watch cache, so a reconcile with nothing to change reads and writes nothing.

Stale-cache safety: what is applied is rendered from the spec alone; the cached child only decides
*whether* to apply. Server-side apply sets only the fields this manager owns (`force` takes back only
those), so an apply made from a cache that missed someone's newer edit cannot remove fields the editor
owns; an edit of a field the operator owns is drift, put back by design.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from mooncake_operator.api.group import FIELD_MANAGER, GROUP, KIND
from mooncake_operator.api.quantities import parse_quantity
from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.build.digests import json_digest
from mooncake_operator.build.inference_pool import INFERENCE_POOL_API_VERSION, INFERENCE_POOL_KIND
from mooncake_operator.build.master import ChildRef
from mooncake_operator.build.names import COMPONENT_REPLICA, LABEL_COMPONENT, LABEL_MANAGED_BY, MANAGED_BY
from mooncake_operator.build.ownership import controlled_by
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.kube.errors import KubeApiError
from mooncake_operator.reconcile.act.cache import WatchCache

Manifest = dict[str, Any]

APPLIED_HASH_ANNOTATION = f"{GROUP}/applied-hash"


def manifest_hash(manifest: Mapping[str, Any]) -> str:
    return json_digest(manifest)


def with_applied_hash(manifest: Manifest) -> Manifest:
    """The manifest carrying the digest of itself (computed before the annotation is added)."""
    digest = manifest_hash(manifest)
    metadata = dict(manifest["metadata"])
    metadata["annotations"] = {**metadata.get("annotations", {}), APPLIED_HASH_ANNOTATION: digest}
    return {**manifest, "metadata": metadata}


def _quantity(value: Any) -> Decimal | None:
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    try:
        return parse_quantity(value)
    except ValueError:
        return None


def _same_scalar(desired: Any, live: Any) -> bool:
    """Equal, or the same quantity written differently (the API server canonicalizes `4` to "4",
    "0.5" to "500m")."""
    if desired == live:
        return True
    left, right = _quantity(desired), _quantity(live)
    return left is not None and left == right


def holds(desired: Any, live: Any) -> bool:
    """Whether `live` still holds every value of `desired`. Maps may carry more keys (server defaults,
    other managers); lists must match element by element."""
    if isinstance(desired, Mapping):
        return isinstance(live, Mapping) and all(
            key in live and holds(value, live[key]) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(desired) == len(live)
            and all(holds(d, item) for d, item in zip(desired, live, strict=True))
        )
    return _same_scalar(desired, live)


def needs_apply(desired: Manifest, live: Mapping[str, Any] | None) -> str | None:
    """Why `desired` (carrying its applied hash) must be applied over `live`, or None."""
    if live is None:
        return "missing"
    annotations = (live.get("metadata") or {}).get("annotations") or {}
    wanted = desired["metadata"]["annotations"][APPLIED_HASH_ANNOTATION]
    if annotations.get(APPLIED_HASH_ANNOTATION) != wanted:
        return "changed"
    if not holds(desired, live):
        return "drifted"
    return None


class ImmutableChangeError(Exception):
    """A rendered child changes a field the API server will not let change; nothing was applied."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


def immutable_changes(desired: Manifest, live: Mapping[str, Any] | None) -> list[str]:
    """Why `desired` cannot be applied over `live`: a StatefulSet's volumeClaimTemplates are immutable.

    Re-creating the StatefulSet would not help: its claims already exist under the same names and would
    be reused with their old class and size. So the change is refused, with what to do instead.
    """
    if live is None or desired["kind"] != "StatefulSet":
        return []
    wanted = desired["spec"].get("volumeClaimTemplates", [])
    present = (live.get("spec") or {}).get("volumeClaimTemplates") or []
    if len(wanted) == len(present) and holds(wanted, present):
        return []
    name = desired["metadata"]["name"]
    return [
        "spec.model.cache: the per-replica cache claims (model.cache.volumeClaimTemplate) cannot change "
        f"once StatefulSet {name} exists (Kubernetes keeps volumeClaimTemplates immutable, and the "
        f"existing claims hf-cache-{name}-<i> would be reused unchanged). Restore the previous "
        f"model.cache, or delete StatefulSet {name} (and the claims, to re-size them) to let the operator "
        "re-create it"
    ]


class ApplyError(Exception):
    """The API server refused a child (a 409 conflict, a 422 the schema refuses, a 500): what and why."""

    def __init__(self, kind: str, name: str, error: KubeApiError) -> None:
        self.kind, self.name, self.error = kind, name, error
        super().__init__(f"applying {kind}/{name} failed: {error}")


@dataclass(frozen=True)
class AppliedChild:
    kind: str
    name: str
    why: str | None  # None: already as rendered, nothing written


async def ensure_children(
    kube: KubeClient, cache: WatchCache, manifests: Sequence[Manifest]
) -> list[AppliedChild]:
    """Apply, in order, each child that needs it; returns what happened to each.

    Every child is read (from the watch cache) before any is written, so a change the API server would
    refuse on one child (ImmutableChangeError) leaves all of them as they were.
    """
    pairs = []
    for manifest in manifests:
        desired = with_applied_hash(manifest)
        metadata = desired["metadata"]
        live = cache.get(desired["apiVersion"], desired["kind"], metadata["namespace"], metadata["name"])
        pairs.append((desired, live))
    problems = [problem for desired, live in pairs for problem in immutable_changes(desired, live)]
    if problems:
        raise ImmutableChangeError(problems)
    results = []
    for desired, live in pairs:
        why = needs_apply(desired, live)
        if why is not None:
            try:
                await kube.apply(desired, field_manager=FIELD_MANAGER)
            except KubeApiError as error:
                raise ApplyError(desired["kind"], desired["metadata"]["name"], error) from error
        results.append(AppliedChild(desired["kind"], desired["metadata"]["name"], why))
    return results


async def scale_down_retired(
    kube: KubeClient, cache: WatchCache, namespace: str, refs: Sequence[ChildRef]
) -> list[ChildRef]:
    """Scale to zero the workloads the spec no longer renders (e.g. the single master's Deployment after a
    switch to highly available masters) when they exist, are this operator's and still run pods (the
    watch cache holds only objects labelled as this operator's)."""
    scaled = []
    for ref in refs:
        live = cache.get(ref.api_version, ref.kind, namespace, ref.name)
        if live is None:
            continue
        labels = (live.get("metadata") or {}).get("labels") or {}
        if labels.get(LABEL_MANAGED_BY) != MANAGED_BY or (live.get("spec") or {}).get("replicas") == 0:
            continue
        patch = {"spec": {"replicas": 0}}
        await kube.patch_merge(
            ref.api_version, ref.kind, ref.name, patch, namespace, field_manager=FIELD_MANAGER
        )
        scaled.append(ref)
    return scaled


async def remove_replica_sets(
    kube: KubeClient, cache: WatchCache, namespace: str, names: Sequence[str], owner_uid: str
) -> None:
    """Delete replica StatefulSets the plan retired (an old BlueGreen set, a candidate no longer wanted);
    the garbage collector then deletes their pods. Only sets found in the watch cache as this resource's
    replica sets (its controller reference, by UID) are deleted, and only that very object (the delete's
    UID precondition); each is forgotten at once, so the next pass does not count it as live."""
    for name in names:
        live = cache.get("apps/v1", "StatefulSet", namespace, name)
        if live is None or not controlled_by(live, KIND, owner_uid):
            continue
        labels = (live.get("metadata") or {}).get("labels") or {}
        if labels.get(LABEL_MANAGED_BY) != MANAGED_BY or labels.get(LABEL_COMPONENT) != COMPONENT_REPLICA:
            continue
        uid = (live.get("metadata") or {}).get("uid")
        await kube.delete("apps/v1", "StatefulSet", name, namespace, missing_ok=True, uid=uid)
        cache.forget("apps/v1", "StatefulSet", namespace, name)


async def remove_inference_pool(
    kube: KubeClient, cache: WatchCache, resource: MooncakeServing, owner_uid: str
) -> bool:
    """Delete the resource's InferencePool once spec.inferencePool is unset (the gateway would otherwise
    keep routing to it): only the one this resource controls (controller reference, by UID)."""
    namespace, name = resource.metadata.namespace, resource.metadata.name
    live = cache.get(INFERENCE_POOL_API_VERSION, INFERENCE_POOL_KIND, namespace, name)
    if live is None or not controlled_by(live, KIND, owner_uid):
        return False
    uid = (live.get("metadata") or {}).get("uid")
    await kube.delete(
        INFERENCE_POOL_API_VERSION, INFERENCE_POOL_KIND, name, namespace, missing_ok=True, uid=uid
    )
    cache.forget(INFERENCE_POOL_API_VERSION, INFERENCE_POOL_KIND, namespace, name)
    return True
