"""build/etcd.py: the HA topology, the etcd CA volume and the operator-run etcd (exact, per case)."""

from __future__ import annotations

import dataclasses

import pytest
from tests.unit.builders.cases import CASES, OWNER_UID
from tests.unit.builders.golden import assert_golden

from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.build.etcd import (
    etcd_ca_mounts,
    etcd_ca_volumes,
    etcd_service,
    etcd_stateful_set,
    ha_cluster_id,
    ha_enabled,
    ha_topology,
    managed_etcd_endpoints,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", sorted(CASES))
def test_etcd(case: str) -> None:
    resource: MooncakeServing = CASES[case]()
    topology = ha_topology(resource)
    built = {
        "haEnabled": ha_enabled(resource),
        "clusterId": ha_cluster_id(resource),
        "managedEndpoints": managed_etcd_endpoints(resource),
        "topology": dataclasses.asdict(topology) if topology is not None else None,
        "caVolumes": etcd_ca_volumes(resource),
        "caMounts": etcd_ca_mounts(resource),
    }
    managed = resource.spec.store.master.high_availability.etcd.managed_or_default()
    if ha_enabled(resource) and managed is not None:
        built["service"] = etcd_service(resource, owner_uid=OWNER_UID)
        built["statefulSet"] = etcd_stateful_set(resource, owner_uid=OWNER_UID)
    assert_golden("etcd", case, built)
