"""The short content digests the operator names things by: the applied-hash annotation, the config and
spec hashes, the replica template's id, the KV fingerprint. One definition, so that equal content
always gets an equal name."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from mooncake_operator.api.spec import MooncakeServingSpec

DIGEST_LENGTH = 16  # hex digits: 64 bits, short enough for a label value


def short_digest(text: str) -> str:
    """The first DIGEST_LENGTH hex digits of the SHA-256 of `text` (UTF-8)."""
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_LENGTH]


def canonical_json(value: Any) -> str:
    """`value` as JSON with sorted keys and no spaces: equal values, equal text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def json_digest(value: Any) -> str:
    """The short digest of `value`'s canonical JSON."""
    return short_digest(canonical_json(value))


def spec_hash(spec: MooncakeServingSpec) -> str:
    """The spec revision: a short stable digest of a spec (status revisions, the last good record)."""
    return json_digest(spec.to_wire())
