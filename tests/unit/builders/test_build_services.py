"""build/services.py: the replicas' headless and client Services (exact, per case)."""

from __future__ import annotations

import pytest
from tests.unit.builders.cases import CASES, OWNER_UID
from tests.unit.builders.golden import assert_golden

from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.build.services import client_service, headless_service

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", sorted(CASES))
def test_services(case: str) -> None:
    resource: MooncakeServing = CASES[case]()
    assert_golden(
        "services",
        case,
        {
            "headless": headless_service(resource, owner_uid=OWNER_UID),
            "client": client_service(resource, owner_uid=OWNER_UID),
        },
    )
