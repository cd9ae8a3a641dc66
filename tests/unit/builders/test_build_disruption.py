"""build/disruption.py: the replicas' PodDisruptionBudget in both API versions (exact, per case)."""

from __future__ import annotations

import pytest
from tests.unit.builders.cases import CASES, OWNER_UID
from tests.unit.builders.golden import assert_golden

from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.build.disruption import POLICY_V1BETA1, pod_disruption_budget

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", sorted(CASES))
def test_disruption(case: str) -> None:
    resource: MooncakeServing = CASES[case]()
    assert_golden(
        "disruption",
        case,
        {
            "v1": pod_disruption_budget(resource, owner_uid=OWNER_UID),
            "v1beta1": pod_disruption_budget(resource, owner_uid=OWNER_UID, api_version=POLICY_V1BETA1),
        },
    )


def test_an_unknown_policy_version_is_refused() -> None:
    with pytest.raises(ValueError, match="must be one of"):
        pod_disruption_budget(CASES["minimax-m2.5-eagle3"](), owner_uid=None, api_version="policy/v2")
