"""The last good revision: the spec the last passing canary proved, kept in an owned ConfigMap (pure:
its manifest, and whether a stored one is trusted; `act.revisions` writes it).

`onFailure: Rollback` renders the children from it instead of the user's spec, which is never rewritten.
The ConfigMap (NAME-last-good, key spec.json) is a child like the others: it goes with its owner.

Anyone allowed to edit ConfigMaps in the namespace could edit it, so it is trusted only when the digest of
the spec it holds is `status.lastGoodRevision` (recorded when the canary passed): a changed, unreadable
or missing one is refused, and the refusal is shown in the Ready condition.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from mooncake_operator.api.group import GROUP
from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.api.spec import MooncakeServingSpec
from mooncake_operator.build.digests import spec_hash
from mooncake_operator.build.names import labels, object_meta

REVISION_ANNOTATION = f"{GROUP}/revision"
SPEC_KEY = "spec.json"
COMPONENT = "last-good"


def config_map_name(name: str) -> str:
    return f"{name}-last-good"


@dataclass(frozen=True)
class LastGood:
    spec_revision: str  # build.digests.spec_hash of `spec`
    spec: MooncakeServingSpec


def last_good_manifest(
    resource: MooncakeServing, spec: MooncakeServingSpec, *, owner_uid: str
) -> dict[str, Any]:
    revision = spec_hash(spec)
    metadata = object_meta(
        resource,
        config_map_name(resource.metadata.name),
        labels(resource, "mooncake-serving", COMPONENT),
        owner_uid,
    )
    metadata["annotations"] = {REVISION_ANNOTATION: revision}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata,
        "data": {SPEC_KEY: json.dumps(spec.to_wire(), indent=2, sort_keys=True) + "\n"},
    }


def parse_last_good(config_map: dict[str, Any] | None) -> LastGood | None:
    """The stored spec, or None when absent or unreadable (then there is nothing to roll back to)."""
    if config_map is None:
        return None
    text = (config_map.get("data") or {}).get(SPEC_KEY)
    if not text:
        return None
    try:
        spec = MooncakeServingSpec.model_validate(json.loads(text))
    except (ValueError, ValidationError):
        return None
    return LastGood(spec_hash(spec), spec)


def verified_last_good(
    config_map: dict[str, Any] | None, recorded: str | None
) -> tuple[LastGood | None, str | None]:
    """(the stored spec, None) when it is the recorded last good revision; (None, why) when it must not
    be trusted; (None, None) when no revision has been recorded yet (nothing to roll back to)."""
    if recorded is None:
        return None, None
    name = (config_map or {}).get("metadata", {}).get("name", "the last-good ConfigMap")
    if config_map is None:
        return None, f"the last-good ConfigMap holding revision {recorded} is missing"
    stored = parse_last_good(config_map)
    if stored is None:
        return None, f"ConfigMap {name} is unreadable (key {SPEC_KEY}): not revision {recorded}"
    if stored.spec_revision != recorded:
        return None, (
            f"ConfigMap {name} holds a spec with digest {stored.spec_revision}, but status.lastGoodRevision "
            f"is {recorded}: it was changed after the canary proved it"
        )
    return stored, None
