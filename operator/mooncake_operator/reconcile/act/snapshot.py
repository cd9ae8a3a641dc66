"""What one pass observes, read from the watch cache: the master, the replica set rendered from the spec,
the resource's other replica sets and pods, and foreign pods in its client Service
(`decide.observe` turns them into readiness).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mooncake_operator.api.group import KIND
from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.build.etcd import ha_enabled
from mooncake_operator.build.names import COMPONENT_MASTER, COMPONENT_REPLICA, TEMPLATE_ANNOTATION, ChildNames
from mooncake_operator.build.ownership import controlled_by, controller_reference
from mooncake_operator.reconcile.act.cache import MAX_FOREIGN_NAMES, WatchCache, in_client_service
from mooncake_operator.reconcile.decide.observe import (
    LiveSet,
    Observation,
    RolloutView,
    component_of,
    ha_master_rollout_state,
    live_set,
    master_state,
    name_of,
    pod_info,
    replica_state,
)


def owned_replica_sets(cache: WatchCache, resource: MooncakeServing) -> dict[str, Mapping[str, Any]]:
    """The resource's replica StatefulSets, by UID: those whose controller is this MooncakeServing (its
    UID, not only its name: a resource deleted and re-created under the name is another owner)."""
    found: dict[str, Mapping[str, Any]] = {}
    for stateful_set in cache.owned(
        "apps/v1", "StatefulSet", resource.metadata.namespace, resource.metadata.name
    ):
        metadata = stateful_set.get("metadata") or {}
        if component_of(stateful_set) == COMPONENT_REPLICA and controlled_by(
            stateful_set, KIND, resource.metadata.uid
        ):
            found[str(metadata.get("uid") or "")] = stateful_set
    return found


def replica_sets(cache: WatchCache, resource: MooncakeServing) -> list[LiveSet]:
    """The resource's replica StatefulSets (not being deleted), by name, each with the pods it created."""
    found = []
    pods = cache.owned("v1", "Pod", resource.metadata.namespace, resource.metadata.name)
    owned = owned_replica_sets(cache, resource)
    for stateful_set in cache.owned(
        "apps/v1", "StatefulSet", resource.metadata.namespace, resource.metadata.name
    ):
        metadata = stateful_set.get("metadata") or {}
        if component_of(stateful_set) != COMPONENT_REPLICA or metadata.get("deletionTimestamp"):
            continue
        uid = str(metadata.get("uid") or "")
        created = [
            pod
            for pod in pods
            if uid in owned
            and (controller_reference(pod) or {}).get("kind") == "StatefulSet"
            and (controller_reference(pod) or {}).get("uid") == uid
        ]
        template = (metadata.get("annotations") or {}).get(TEMPLATE_ANNOTATION)
        found.append(live_set(stateful_set, created, template))
    return sorted(found, key=lambda live: live.name)


def observe(
    cache: WatchCache,
    resource: MooncakeServing,
    replica_set: str | None = None,
    rollout: RolloutView | None = None,
) -> Observation:
    """From the watch cache: the master, the replica set `replica_set` (default NAME-replica) and the
    resource's pods, by component and set; `rollout`: the InPlace rollout's new and kept pods."""
    name, namespace = resource.metadata.name, resource.metadata.namespace
    names = ChildNames.of(name)
    set_name = replica_set or names.replicas
    ha = ha_enabled(resource)
    master_kind = "StatefulSet" if ha else "Deployment"
    master_workload = cache.get("apps/v1", master_kind, namespace, names.master)
    stateful_set = cache.get("apps/v1", "StatefulSet", namespace, set_name)
    pods = cache.owned("v1", "Pod", namespace, name)
    master_pods = [pod for pod in pods if component_of(pod) == COMPONENT_MASTER]
    # A replica pod is one a replica StatefulSet of this resource created (the controller reference's
    # UIDs, pod -> StatefulSet -> this MooncakeServing): labels and names alone are anyone's to copy.
    sets = owned_replica_sets(cache, resource)
    set_uids = {uid for uid, found in sets.items() if name_of(found) == set_name}
    own, other_pods, foreign = [], [], set(cache.foreign_pods(namespace, name))
    for pod in pods:
        reference = controller_reference(pod) or {}
        if reference.get("kind") == "StatefulSet" and reference.get("uid") in set_uids:
            own.append(pod)
        elif reference.get("kind") == "StatefulSet" and reference.get("uid") in sets:
            other_pods.append(pod)
        elif component_of(pod) != COMPONENT_MASTER and in_client_service(pod) == name:
            foreign.add(name_of(pod))
    others = tuple(sorted((pod_info(pod) for pod in other_pods), key=lambda info: info.name))
    master = (
        ha_master_rollout_state(resource, master_workload, master_pods)
        if ha
        else master_state(master_workload, master_pods)
    )
    replicas = replica_state(resource, stateful_set if set_uids else None, own, set_name, rollout=rollout)
    return Observation(master, replicas, others, tuple(sorted(foreign)[:MAX_FOREIGN_NAMES]))
