"""What every pod of a resource shares, whatever its kind: hardening, placement fields, container
resources, the user's extra pod labels, and the one-pod-per-node spread of masters and etcd members.
"""

from __future__ import annotations

from typing import Any

from mooncake_operator.api.kube_types import HOSTNAME_TOPOLOGY_KEY, ResourceRequirements
from mooncake_operator.api.replica_pod import Scheduling
from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.api.spec import MooncakeServingSpec
from mooncake_operator.build.names import selector


def container_resources(requirements: ResourceRequirements) -> dict[str, dict[str, str | int]]:
    out: dict[str, dict[str, str | int]] = {}
    if requirements.requests:
        out["requests"] = dict(requirements.requests)
    if requirements.limits:
        out["limits"] = dict(requirements.limits)
    return out


def pod_hardening(spec: MooncakeServingSpec) -> dict[str, Any]:
    """Pod-level settings every pod of the resource shares: no API token (they never call the API, and
    trustRemoteCode runs model code; replicas with pod.serviceAccountName say so themselves), the image
    pull secrets."""
    out: dict[str, Any] = {"automountServiceAccountToken": False}
    if spec.image_pull_secrets:
        out["imagePullSecrets"] = [secret.to_wire() for secret in spec.image_pull_secrets]
    return out


def scheduling_fields(scheduling: Scheduling | None) -> dict[str, Any]:
    """The Kubernetes scheduling fields of `scheduling`, unchanged (affinity handled by the caller)."""
    if scheduling is None:
        return {}
    wire = scheduling.to_wire()
    return {
        key: wire[key]
        for key in ("nodeSelector", "tolerations", "topologySpreadConstraints", "priorityClassName")
        if key in wire
    }


def extra_pod_labels(spec: MooncakeServingSpec) -> dict[str, str]:
    return dict(spec.pod_metadata.labels or {}) if spec.pod_metadata is not None else {}


def with_spread(user: dict[str, Any] | None, resource: MooncakeServing, component: str) -> dict[str, Any]:
    """The user's affinity plus a preference for one pod per node: a node failure then takes at most one
    master (or etcd member). The user's terms all stay; ours is appended."""
    affinity = dict(user or {})
    anti = dict(affinity.get("podAntiAffinity", {}))
    key = "preferredDuringSchedulingIgnoredDuringExecution"
    term = {
        "topologyKey": HOSTNAME_TOPOLOGY_KEY,
        "labelSelector": {"matchLabels": selector(resource, component)},
    }
    anti[key] = [*anti.get(key, []), {"weight": 100, "podAffinityTerm": term}]
    affinity["podAntiAffinity"] = anti
    return affinity
