"""The customer's deployment as a MooncakeServing, shipped as package data.

`examples/minimax-m2.5-eagle3.yaml` in the repository is the same file (a test fails when they drift), so
the sandbox, the tests and a user reading the examples all start from one description.
"""

from __future__ import annotations

from importlib import resources

from mooncake_operator import safe_yaml
from mooncake_operator.api.resource import MooncakeServing, parse_resource

CUSTOMER_EXAMPLE = "minimax-m2.5-eagle3.yaml"


def customer_deployment_yaml() -> str:
    """The example's YAML text, exactly as shipped."""
    return resources.files("mooncake_operator").joinpath("data", CUSTOMER_EXAMPLE).read_text(encoding="utf-8")


def customer_deployment() -> MooncakeServing:
    """The customer's MiniMax-M2.5 + Eagle-3 deployment, validated."""
    return parse_resource(safe_yaml.load(customer_deployment_yaml()))
