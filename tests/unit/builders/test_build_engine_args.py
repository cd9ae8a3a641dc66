"""build/engine_args.py: the replicas' and masters' command lines, environment and store config, and the
KV fingerprint (exact, per case). tests/unit/test_engine_args.py holds the rules behind them."""

from __future__ import annotations

import pytest
from tests.unit.builders.cases import CASES
from tests.unit.builders.golden import assert_golden

from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.build.engine_args import kv_fingerprint, master_argv, replica_launch
from mooncake_operator.build.etcd import ha_topology
from mooncake_operator.build.store_config import master_address

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_args(case: str) -> None:
    resource: MooncakeServing = CASES[case]()
    spec, ha = resource.spec, ha_topology(resource)
    launch = replica_launch(spec, master_address=master_address(resource), port=spec.engine.port, ha=ha)
    assert_golden(
        "engine_args",
        case,
        {
            "replicaArgv": list(launch.argv),
            "replicaEnv": dict(launch.env),
            "storeConfig": dict(launch.store_config),
            "masterArgv": list(master_argv(spec, ha=ha)),
            "kvFingerprint": kv_fingerprint(spec),
        },
    )
