"""build/network_policy.py: the NetworkPolicies, with the operator's defaults and with deny-by-default
from another operator namespace (exact, per case)."""

from __future__ import annotations

import pytest
from tests.unit.builders.cases import CASES, OWNER_UID
from tests.unit.builders.golden import assert_golden

from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.build.network_policy import network_policies

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", sorted(CASES))
def test_network_policies(case: str) -> None:
    resource: MooncakeServing = CASES[case]()
    assert_golden(
        "network_policy",
        case,
        {
            "defaults": network_policies(resource, owner_uid=OWNER_UID),
            "listedClientsFromOps": network_policies(
                resource, owner_uid=OWNER_UID, operator_namespace="ops", open_http_by_default=False
            ),
        },
    )
