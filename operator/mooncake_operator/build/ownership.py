"""Who created an object, by its controller ownerReference: the one proof of ownership the API server
keeps (labels, names and a pod's hostname are anyone's to copy within a namespace). Shared by the
operator's watch cache and `canary --resource`, which must not import the reconcile package."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def controller_reference(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The object's controller ownerReference (at most one exists), or None."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            return ref
    return None


def controlled_by(obj: Mapping[str, Any], kind: str, uid: str | None) -> bool:
    """`obj`'s controller is the `kind` object with UID `uid` (never when the UID is unknown)."""
    reference = controller_reference(obj) or {}
    return bool(uid) and reference.get("kind") == kind and reference.get("uid") == uid
