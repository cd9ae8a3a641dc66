"""Exact-output checks against golden files, one file per builder module and case (as cloudnative-pg's
pkg/specs tests do): tests/unit/builders/golden/<module>/<case>.yaml holds what the module builds.

After an intended change, regenerate them and review the diff before committing:
    MOONCAKE_OPERATOR_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/builders tests/unit/test_render.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from mooncake_operator.build.manifests import to_yaml_stream

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("MOONCAKE_OPERATOR_UPDATE_GOLDEN") == "1"


def assert_golden(module: str, case: str, built: dict[str, Any]) -> None:
    """`built` (what the module returns, by name) is exactly golden/<module>/<case>.yaml."""
    built = json.loads(json.dumps(built))  # plain JSON values: tuples as lists, as the wire has them
    text = to_yaml_stream([built])
    path = GOLDEN / module / f"{case}.yaml"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"{path} is missing: run with MOONCAKE_OPERATOR_UPDATE_GOLDEN=1 to create it"
    expected = path.read_text(encoding="utf-8")
    assert text == expected, (
        f"{path.relative_to(GOLDEN.parent)} differs from what build/{module}.py builds; if the change is "
        "intended, rerun with MOONCAKE_OPERATOR_UPDATE_GOLDEN=1 and review the diff"
    )
    assert yaml.safe_load(expected) == built  # the stream reads back as the very value
