"""Small helpers for tests that vary one field of a manifest."""

from __future__ import annotations

import copy
from typing import Any


def with_change(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of `obj` with one field (dotted wire path) set; `None` deletes the field."""
    changed = copy.deepcopy(obj)
    *parents, leaf = path.split(".")
    node = changed
    for part in parents:
        node = node.setdefault(part, {})
    if value is None:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return changed
