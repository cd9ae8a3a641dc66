"""build/names.py: the children's names, labels, selectors and addresses (exact, per case)."""

from __future__ import annotations

import dataclasses

import pytest
from tests.unit.builders.cases import CASES, OWNER_UID
from tests.unit.builders.golden import assert_golden

from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.build.names import (
    COMPONENT_MASTER,
    COMPONENT_REPLICA,
    ChildNames,
    HaNames,
    client_selector,
    labels,
    master_pod_urls,
    object_meta,
    owner_reference,
    replica_pod_names,
    replica_selector_string,
    replica_set_name,
    replica_urls,
    selector,
    service_selector,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", sorted(CASES))
def test_names(case: str) -> None:
    resource: MooncakeServing = CASES[case]()
    name = resource.metadata.name
    candidate = replica_set_name(resource, "0a1b2c3d4e5f")
    assert_golden(
        "names",
        case,
        {
            "childNames": dataclasses.asdict(ChildNames.of(name)),
            "haNames": dataclasses.asdict(HaNames.of(name)),
            "replicaLabels": labels(resource, "vllm", COMPONENT_REPLICA),
            "masterSelector": selector(resource, COMPONENT_MASTER),
            "replicaSelectorString": replica_selector_string(resource),
            "serviceSelector": service_selector(resource),
            "clientSelector": client_selector(name),
            "ownerReference": owner_reference(resource, OWNER_UID),
            "objectMeta": object_meta(resource, f"{name}-x", {"a": "b"}, OWNER_UID),
            "objectMetaWithoutOwner": object_meta(resource, f"{name}-x", {"a": "b"}, None),
            "replicaSet": replica_set_name(resource),
            "candidateSet": candidate,
            "replicaPods": replica_pod_names(resource),
            "candidatePods": replica_pod_names(resource, candidate),
            "replicaUrls": replica_urls(resource),
            "masterPodUrls": master_pod_urls(resource),
        },
    )
