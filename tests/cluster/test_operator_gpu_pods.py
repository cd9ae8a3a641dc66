"""GPU-cluster settings through the operator on a real API server: combinations the models refuse leave the
resource Invalid with nothing applied, and a change of the per-replica cache claims (immutable in a
StatefulSet) is refused the same way, touching none of the children already there.
"""

from __future__ import annotations

from typing import Any

import pytest
from tests.cluster.operator_harness import (
    RunningOperator,
    children,
    condition,
    eventually,
    serving,
    wait_for_phase,
)

from mooncake_operator.api.group import API_VERSION, KIND
from mooncake_operator.kube.client import KubeClient

RDMA_WITHOUT_DEVICE = {
    "globalSegmentSize": "1GB",
    "localBufferSize": "512MB",
    "protocol": "rdma",
    "deviceName": "mlx5_0",
}

# (spec changes, what the Ready condition's message must name)
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "rdma-without-a-device": ({"store": RDMA_WITHOUT_DEVICE}, "store.rdma.resourceName"),
    "host-network-with-preferred-anti-affinity": (
        {
            "store": {**RDMA_WITHOUT_DEVICE, "rdma": {"resourceName": "rdma/ib", "hostNetwork": True}},
            "scheduling": {"replicaAntiAffinity": "Preferred"},
        },
        "scheduling.replicaAntiAffinity",
    ),
    "managed-flag-with-underscores": (
        {"engine": {"image": "registry.invalid/e:1", "blockSize": 32, "extraArgs": ["--block_size=64"]}},
        "engine.extraArgs must not contain --block-size",
    ),
    "managed-flag-dotted": (
        {
            "engine": {
                "image": "registry.invalid/e:1",
                "blockSize": 32,
                "extraArgs": ["--speculative-config.num_speculative_tokens=7"],
            }
        },
        "engine.extraArgs must not contain --speculative-config",
    ),
    "operator-label-in-pod-metadata": (
        {"podMetadata": {"labels": {"app.kubernetes.io/instance": "other"}}},
        "podMetadata.labels",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
async def test_refused_combinations_mark_the_resource_invalid_and_apply_nothing(
    kube: KubeClient, namespace: str, case: str, operator: RunningOperator
) -> None:
    changes, mentions = REFUSED[case]
    await kube.create(serving(namespace, **changes))  # the CRD schema admits it
    invalid = await wait_for_phase(kube, namespace, "Invalid")
    ready = condition(invalid, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert mentions in ready["message"], ready["message"]
    assert await children(kube, namespace) == {}
    assert operator.runtime.kube.counts.by_verb["apply"] == 0


async def test_a_changed_cache_claim_template_is_refused_and_nothing_is_applied(
    kube: KubeClient, namespace: str, operator: RunningOperator
) -> None:
    claim = {"volumeClaimTemplate": {"size": "10Gi", "storageClassName": "fast"}}
    await kube.create(serving(namespace, model={"name": "MiniMaxAI/MiniMax-M2.5", "cache": claim}))

    async def all_children() -> dict[str, Any] | None:
        found = await children(kube, namespace)
        return found if "StatefulSet/demo-replica" in found and len(found) >= 9 else None

    before = await eventually(all_children, what="the children")
    templates = before["StatefulSet/demo-replica"]["spec"]["volumeClaimTemplates"]
    assert [(t["metadata"]["name"], t["spec"]["resources"]["requests"]["storage"]) for t in templates] == [
        ("hf-cache", "10Gi")
    ]
    applies = operator.runtime.kube.counts.by_verb["apply"]

    # A bigger claim, and a master port change that would otherwise be applied to other children.
    bigger = {"volumeClaimTemplate": {"size": "20Gi", "storageClassName": "fast"}}
    patch = {"spec": {"model": {"cache": bigger}, "store": {"master": {"rpcPort": 50052}}}}
    await kube.patch_merge(API_VERSION, KIND, "demo", patch, namespace)
    invalid = await wait_for_phase(kube, namespace, "Invalid")
    message = condition(invalid, "Ready")["message"]
    assert "model.cache.volumeClaimTemplate" in message and "StatefulSet demo-replica" in message, message

    assert operator.runtime.kube.counts.by_verb["apply"] == applies, "something was applied"
    after = await children(kube, namespace)
    for key, child in before.items():  # statuses move (controllers); what the operator writes does not
        assert after[key].get("spec", after[key].get("data")) == child.get("spec", child.get("data")), key
