"""The reference deployment as a MooncakeServing, shipped as package data.

`examples/minimax-m2.5-eagle3.yaml` in the repository is the same file (a test fails when they drift), so
the sandbox, the tests and a user reading the examples all start from one description.
"""

from __future__ import annotations

from importlib import resources

from mooncake_operator import safe_yaml
from mooncake_operator.api.resource import MooncakeServing, parse_resource

REFERENCE_EXAMPLE = "minimax-m2.5-eagle3.yaml"


def reference_deployment_yaml() -> str:
    """The example's YAML text, exactly as shipped."""
    return (
        resources.files("mooncake_operator").joinpath("data", REFERENCE_EXAMPLE).read_text(encoding="utf-8")
    )


def reference_deployment() -> MooncakeServing:
    """The reference MiniMax-M2.5 + Eagle-3 deployment, validated."""
    return parse_resource(safe_yaml.load(reference_deployment_yaml()))
