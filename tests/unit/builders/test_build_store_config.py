"""build/store_config.py: mooncake_store.json, its ConfigMap and the master address (exact, per case)."""

from __future__ import annotations

import pytest
from tests.unit.builders.cases import CASES, OWNER_UID
from tests.unit.builders.golden import assert_golden

from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.build.store_config import (
    config_hash,
    master_address,
    store_config_json,
    store_config_map,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", sorted(CASES))
def test_store_config(case: str) -> None:
    resource: MooncakeServing = CASES[case]()
    assert_golden(
        "store_config",
        case,
        {
            "masterAddress": master_address(resource),
            "storeConfigJson": store_config_json(resource),
            "configHash": config_hash(resource),
            "configMap": store_config_map(resource, owner_uid=OWNER_UID),
        },
    )
