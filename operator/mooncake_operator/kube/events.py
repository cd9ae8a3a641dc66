"""core/v1 Events about an object, as the operator posts them."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final

from mooncake_operator.kube.kinds import Manifest, manifest_identity

_EVENT_MESSAGE_LIMIT: Final = 1024


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def event_manifest(
    involved: Mapping[str, Any],
    *,
    reason: str,
    message: str,
    type: str,
    component: str,
) -> Manifest:
    """A core/v1 Event for `involved`, in its namespace (or `default` for cluster-scoped objects)."""
    if type not in ("Normal", "Warning"):
        raise ValueError(f"event type must be Normal or Warning, got {type!r}")
    api_version, kind, name, namespace = manifest_identity(involved)
    metadata = involved.get("metadata") or {}
    reference = {"apiVersion": api_version, "kind": kind, "name": name}
    if namespace:
        reference["namespace"] = namespace
    for key in ("uid", "resourceVersion"):
        if metadata.get(key):
            reference[key] = metadata[key]
    now = _now()
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{name}.", "namespace": namespace or "default"},
        "involvedObject": reference,
        "reason": reason,
        "message": message[:_EVENT_MESSAGE_LIMIT],  # kubectl describe shows one line; keep it readable
        "type": type,
        "source": {"component": component},
        "reportingComponent": component,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
