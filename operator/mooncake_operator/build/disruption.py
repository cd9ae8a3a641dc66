"""The replicas' PodDisruptionBudget: at most one replica down through voluntary disruptions."""

from __future__ import annotations

from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.build.names import (
    COMPONENT_REPLICA,
    ChildNames,
    Manifest,
    labels,
    object_meta,
    selector,
)

POLICY_V1 = "policy/v1"
# Kubernetes before 1.21 (such as the 1.20 API server of the cluster tests) serves PodDisruptionBudget
# only as policy/v1beta1, with the same fields; 1.25 and later serve only policy/v1.
POLICY_V1BETA1 = "policy/v1beta1"
POLICY_API_VERSIONS = (POLICY_V1, POLICY_V1BETA1)


def pod_disruption_budget(
    resource: MooncakeServing, *, owner_uid: str | None, api_version: str = POLICY_V1
) -> Manifest:
    """At most one replica down through voluntary disruptions (drains); StatefulSet rollouts do not go
    through evictions, so this does not slow them."""
    if api_version not in POLICY_API_VERSIONS:
        raise ValueError(f"PodDisruptionBudget apiVersion must be one of {POLICY_API_VERSIONS}")
    names = ChildNames.of(resource.metadata.name)
    return {
        "apiVersion": api_version,
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(
            resource, names.replicas, labels(resource, "vllm", COMPONENT_REPLICA), owner_uid
        ),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector(resource, COMPONENT_REPLICA)},
        },
    }
