"""build/pods.py: what every pod of a resource shares (exact, per case)."""

from __future__ import annotations

import pytest
from tests.unit.builders.cases import CASES
from tests.unit.builders.golden import assert_golden

from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.build.names import COMPONENT_ETCD, COMPONENT_MASTER
from mooncake_operator.build.pods import (
    container_resources,
    extra_pod_labels,
    pod_hardening,
    scheduling_fields,
    with_spread,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", sorted(CASES))
def test_pods(case: str) -> None:
    resource: MooncakeServing = CASES[case]()
    spec = resource.spec
    assert_golden(
        "pods",
        case,
        {
            "podHardening": pod_hardening(spec),
            "replicaScheduling": scheduling_fields(spec.scheduling),
            "masterScheduling": scheduling_fields(spec.store.master.scheduling),
            "extraPodLabels": extra_pod_labels(spec),
            "masterResources": container_resources(spec.store.master.resources),
            "masterSpread": with_spread(None, resource, COMPONENT_MASTER),
            "etcdSpreadOverUsers": with_spread({"nodeAffinity": {"x": 1}}, resource, COMPONENT_ETCD),
        },
    )
