"""The traffic label's write against a real kube-apiserver: it reaches only the pod instance observed."""

from __future__ import annotations

from typing import Any

from mooncake_operator.build.names import TRAFFIC_LABEL, TRAFFIC_OFF, TRAFFIC_ON
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.reconcile.act.traffic import set_traffic


def replica_pod(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {TRAFFIC_LABEL: TRAFFIC_OFF}},
        "spec": {"containers": [{"name": "engine", "image": "registry.invalid/none:1"}]},
    }


async def uid_of(kube: KubeClient, name: str, namespace: str) -> str:
    return str((await kube.get("v1", "Pod", name, namespace))["metadata"]["uid"])


async def label_of(kube: KubeClient, name: str, namespace: str) -> str:
    return str((await kube.get("v1", "Pod", name, namespace))["metadata"]["labels"][TRAFFIC_LABEL])


async def test_a_pod_created_again_under_its_name_does_not_get_the_label_decided_for_its_predecessor(
    kube: KubeClient, namespace: str
) -> None:
    names = [f"demo-replica-{ordinal}" for ordinal in range(3)]
    for name in names:
        await kube.create(replica_pod(name, namespace))
    observed = {name: await uid_of(kube, name, namespace) for name in names}  # what the decision saw
    # After the decision: replica-0 is replaced (a StatefulSet keeps the name), replica-2 is deleted.
    await kube.delete("v1", "Pod", "demo-replica-0", namespace)
    await kube.create(replica_pod("demo-replica-0", namespace))
    await kube.delete("v1", "Pod", "demo-replica-2", namespace)
    replacement = await uid_of(kube, "demo-replica-0", namespace)
    assert replacement != observed["demo-replica-0"]

    wanted = dict.fromkeys(observed, TRAFFIC_ON)
    gone = await set_traffic(kube, namespace, wanted, observed)

    assert gone == ["demo-replica-0", "demo-replica-2"]
    assert await label_of(kube, "demo-replica-0", namespace) == TRAFFIC_OFF  # the new instance is unproven
    assert await label_of(kube, "demo-replica-1", namespace) == TRAFFIC_ON  # the one observed still gets it
    assert await uid_of(kube, "demo-replica-0", namespace) == replacement
