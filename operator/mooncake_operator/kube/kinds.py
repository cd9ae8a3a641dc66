"""The kinds the client addresses and their REST paths: the built-in kinds the operator, its chart
and its tests touch, and the MooncakeServing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from mooncake_operator.api.group import API_VERSION, KIND, PLURAL

Manifest = dict[str, Any]
ManifestList = list[Manifest]


@dataclass(frozen=True)
class ResourceKind:
    api_version: str
    kind: str
    plural: str
    namespaced: bool

    @property
    def base_path(self) -> str:
        return f"/api/{self.api_version}" if "/" not in self.api_version else f"/apis/{self.api_version}"


def kinds_by_key(*kinds: ResourceKind) -> dict[tuple[str, str], ResourceKind]:
    return {(k.api_version, k.kind): k for k in kinds}


# The built-in kinds the operator, its chart and its tests touch. Custom kinds are passed to KubeClient
# (it knows nothing of the API it serves; `crd.SERVING_KIND` is the MooncakeServing).
KNOWN_KINDS: Final[Mapping[tuple[str, str], ResourceKind]] = kinds_by_key(
    ResourceKind("v1", "Namespace", "namespaces", namespaced=False),
    ResourceKind("v1", "ConfigMap", "configmaps", namespaced=True),
    ResourceKind("v1", "Secret", "secrets", namespaced=True),
    ResourceKind("v1", "Service", "services", namespaced=True),
    ResourceKind("v1", "Endpoints", "endpoints", namespaced=True),
    ResourceKind("v1", "Pod", "pods", namespaced=True),
    ResourceKind("v1", "ServiceAccount", "serviceaccounts", namespaced=True),
    ResourceKind("v1", "Event", "events", namespaced=True),
    ResourceKind("apps/v1", "Deployment", "deployments", namespaced=True),
    ResourceKind("apps/v1", "StatefulSet", "statefulsets", namespaced=True),
    ResourceKind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets", namespaced=True),
    # Kubernetes before 1.21 (the cluster tests' 1.20 API server) serves it only in policy/v1beta1.
    ResourceKind("policy/v1beta1", "PodDisruptionBudget", "poddisruptionbudgets", namespaced=True),
    ResourceKind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies", namespaced=True),
    ResourceKind("coordination.k8s.io/v1", "Lease", "leases", namespaced=True),
    ResourceKind(
        "authorization.k8s.io/v1", "SelfSubjectAccessReview", "selfsubjectaccessreviews", namespaced=False
    ),
    ResourceKind("rbac.authorization.k8s.io/v1", "Role", "roles", namespaced=True),
    ResourceKind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings", namespaced=True),
    ResourceKind("rbac.authorization.k8s.io/v1", "ClusterRole", "clusterroles", namespaced=False),
    ResourceKind(
        "rbac.authorization.k8s.io/v1", "ClusterRoleBinding", "clusterrolebindings", namespaced=False
    ),
    ResourceKind(
        "apiextensions.k8s.io/v1", "CustomResourceDefinition", "customresourcedefinitions", namespaced=False
    ),
    # The Gateway API Inference Extension's pool (spec.inferencePool), where its CRD is installed.
    ResourceKind("inference.networking.k8s.io/v1", "InferencePool", "inferencepools", namespaced=True),
)


def resource_path(
    kind: ResourceKind,
    *,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """The REST path of a collection, an object, or an object's subresource.

    A namespaced kind's collection without a namespace is the collection across all namespaces.
    """
    if kind.namespaced and not namespace and name:
        raise ValueError(f"{kind.kind} is namespaced: a namespace is required")
    if not kind.namespaced and namespace:
        raise ValueError(f"{kind.kind} is cluster-scoped: got namespace {namespace!r}")
    if subresource and not name:
        raise ValueError("a subresource needs an object name")
    parts = [kind.base_path]
    if namespace:
        parts += ["namespaces", namespace]
    parts.append(kind.plural)
    if name:
        parts.append(name)
    if subresource:
        parts.append(subresource)
    return "/".join(parts)


def manifest_identity(obj: Mapping[str, Any]) -> tuple[str, str, str, str | None]:
    """apiVersion, kind, name, namespace of a manifest; fails clearly when one is missing."""
    metadata = obj.get("metadata") or {}
    api_version, kind, name = obj.get("apiVersion"), obj.get("kind"), metadata.get("name")
    if not (isinstance(api_version, str) and isinstance(kind, str) and isinstance(name, str)):
        raise ValueError(
            f"manifest needs apiVersion, kind and metadata.name; got {api_version!r} {kind!r} {name!r}"
        )
    return api_version, kind, name, metadata.get("namespace")


# The MooncakeServing as the client addresses it (KubeClient(..., kinds=[SERVING_KIND])).
SERVING_KIND: Final = ResourceKind(API_VERSION, KIND, PLURAL, namespaced=True)
