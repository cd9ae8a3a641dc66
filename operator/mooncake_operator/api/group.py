"""The MooncakeServing API's identity: group, version and kind, and the names the operator writes
into objects (field manager, annotation and label keys) so users and tests can rely on them.
"""

from __future__ import annotations

GROUP = "serving.mooncake-operator.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "MooncakeServing"
PLURAL = "mooncakeservings"
SINGULAR = "mooncakeserving"
SHORT_NAMES = ("mcs",)
# Names the operator writes into objects, so users and tests can rely on them: the field manager of every
# server-side apply, and the annotation a user sets to any new value to re-run the canary (after a
# rollback: to retry the spec).
FIELD_MANAGER = "mooncake-operator"
RERUN_CANARY_ANNOTATION = f"{GROUP}/rerun-canary"


# Labels and annotations the operator sets on its pods; spec.podMetadata may not touch them.
OPERATOR_LABEL_KEYS = frozenset(
    {
        "app.kubernetes.io/name",
        "app.kubernetes.io/instance",
        "app.kubernetes.io/component",
        "app.kubernetes.io/part-of",
        "app.kubernetes.io/managed-by",
    }
)
OPERATOR_KEY_PREFIX = f"{GROUP}/"  # traffic label, config-hash and applied-hash annotations, ...


def replica_pod_labels(name: str) -> dict[str, str]:
    """The operator's labels on the replica pods of resource `name` (build.names.labels builds the same)."""
    return {
        "app.kubernetes.io/name": "vllm",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/part-of": "mooncake-serving",
        "app.kubernetes.io/managed-by": "mooncake-operator",
    }
