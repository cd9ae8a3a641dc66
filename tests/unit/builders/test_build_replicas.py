"""build/replicas.py: the replica StatefulSet and pod template, resources, security, drain, placement
(exact, per case)."""

from __future__ import annotations

import pytest
from tests.unit.builders.cases import CASES, OWNER_UID
from tests.unit.builders.golden import assert_golden

from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.build.replicas import (
    drain_command,
    replica_affinity,
    replica_anti_affinity_mode,
    replica_resources,
    replica_security_context,
    replica_stateful_set,
    replica_template_id,
    store_memory_bytes,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", sorted(CASES))
def test_replicas(case: str) -> None:
    resource: MooncakeServing = CASES[case]()
    spec = resource.spec
    candidate = f"{resource.metadata.name}-r0a1b2c3"
    assert_golden(
        "replicas",
        case,
        {
            "statefulSet": replica_stateful_set(resource, owner_uid=OWNER_UID),
            "candidateSetSelector": replica_stateful_set(resource, owner_uid=None, replica_set=candidate)[
                "spec"
            ]["selector"],
            "templateId": replica_template_id(resource),
            "resources": replica_resources(spec),
            "storeMemoryBytes": store_memory_bytes(spec),
            "securityContext": replica_security_context(spec),
            "antiAffinity": replica_anti_affinity_mode(spec),
            "affinity": replica_affinity(resource),
            "drainCommand": drain_command(spec),
        },
    )
