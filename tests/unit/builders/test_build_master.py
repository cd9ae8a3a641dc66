"""build/master.py: the master's workload and Services, single or highly available (exact, per case)."""

from __future__ import annotations

import dataclasses

import pytest
from tests.unit.builders.cases import CASES, OWNER_UID
from tests.unit.builders.golden import assert_golden

from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.build.master import (
    master_children,
    master_placement,
    master_security_context,
    retired_workloads,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", sorted(CASES))
def test_master(case: str) -> None:
    resource: MooncakeServing = CASES[case]()
    assert_golden(
        "master",
        case,
        {
            "children": master_children(resource, owner_uid=OWNER_UID),
            "retiredWorkloads": [dataclasses.asdict(ref) for ref in retired_workloads(resource)],
            "securityContext": master_security_context(),
            "placement": master_placement(resource.spec),
        },
    )
