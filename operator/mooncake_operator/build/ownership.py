"""Owner references: the one proof of ownership the API server keeps (labels, names and a pod's hostname are
anyone's to copy within a namespace). The builders write a controller reference on every child
(`names.owner_reference`); every reader asks here who controls an object: the operator's watch cache and
observation, the removal of replica sets, and `canary --resource`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def owner_references(obj: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The object's ownerReferences (malformed entries left out)."""
    references = (obj.get("metadata") or {}).get("ownerReferences") or []
    return [ref for ref in references if isinstance(ref, Mapping)]


def controller_reference(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The object's controller ownerReference (at most one exists), or None."""
    return next((ref for ref in owner_references(obj) if ref.get("controller") is True), None)


def controlled_by(
    obj: Mapping[str, Any],
    kind: str,
    uid: str | None,
    *,
    api_version: str | None = None,
    any_uid: bool = False,
) -> bool:
    """`obj`'s controller is the `kind` object with UID `uid` (never when the UID is unknown: a resource
    deleted and re-created under its name is another owner); with `api_version`, of that API version;
    with `any_uid`, any object of that kind."""
    reference = controller_reference(obj) or {}
    if reference.get("kind") != kind or (
        api_version is not None and reference.get("apiVersion") != api_version
    ):
        return False
    return any_uid or (bool(uid) and reference.get("uid") == uid)
