"""Borrowed trust within a namespace (issue 21, item 8), on a real API server: a pod that a tenant gives
every label of the client Service's selector, and replica 0's hostname and subdomain (so its DNS record
too), is selected by the client Service (so gets user traffic) but borrows no trust from the operator:
it is reported (status.foreignPods, a ForeignPodInService Warning event), never dialled by the canary and
never relabelled.

The operator runs without a replica-endpoint map, so its canary dials the IPs of the pods it observed.
The replicas' IPs are `FakeKubelet`'s documentation-range addresses, not routed here (the runs are
Inconclusive: unreachable); the foreign pod's IP is loopback, where a fake vLLM listens on the engine
port: one request from the canary to the foreign pod would be recorded there.
"""

from __future__ import annotations

from typing import Any

from tests.cluster.operator_harness import (
    FakeKubelet,
    events,
    eventually,
    get_serving,
    operator_settings,
    pod_status,
    run_operator,
    serving,
    wait_for_phase,
)
from tests.support.apiserver import ControlPlane
from tests.support.fake_vllm import FakeCluster

from mooncake_operator.api.group import API_VERSION, KIND, RERUN_CANARY_ANNOTATION
from mooncake_operator.build.names import TRAFFIC_LABEL, TRAFFIC_ON, client_selector
from mooncake_operator.kube.client import KubeClient

NODE = "fake-node"
FOREIGN = "evil-0"


def foreign_pod(namespace: str) -> dict[str, Any]:
    """What anyone allowed to create pods in the namespace can create: no owner, the client Service's
    labels, replica 0's hostname and subdomain (its DNS name), bound to the node."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": FOREIGN, "namespace": namespace, "labels": client_selector("demo")},
        "spec": {
            "hostname": "demo-replica-0",
            "subdomain": "demo-replicas",
            "nodeName": NODE,
            "containers": [{"name": "vllm", "image": "registry.invalid/impostor:1"}],
        },
    }


async def test_a_foreign_pod_in_the_client_service_is_reported_and_never_dialled(
    kube: KubeClient, kube_cluster: ControlPlane, namespace: str, crd: None
) -> None:
    with FakeCluster.start(1) as impostor:
        port = int(impostor.urls[0].rsplit(":", 1)[1])
        settings = operator_settings(kube_cluster, namespace)  # no endpoint map: the pods' own IPs
        with run_operator(settings):
            async with FakeKubelet(kube, namespace, hold={FOREIGN}, node=NODE):
                await kube.create(serving(namespace, engine={"port": port}))
                first = await wait_for_phase(kube, namespace, "CanaryInconclusive", within=60)
                assert "foreignPods" not in first["status"]
                replicas = [f"demo-replica-{i}" for i in range(2)]
                pods = {p["metadata"]["name"]: p for p in await kube.list("v1", "Pod", namespace)}
                ips = sorted(pods[name]["status"]["podIP"] for name in replicas)
                assert all(ip.startswith("192.0.2.") for ip in ips), ips

                created = await kube.create(foreign_pod(namespace))
                await kube.patch_status(
                    "v1", "Pod", FOREIGN, pod_status(created, ready=True, ip="127.0.0.1"), namespace
                )

                async def reported() -> dict[str, Any] | None:
                    body = await get_serving(kube, namespace)
                    return body if (body.get("status") or {}).get("foreignPods") == [FOREIGN] else None

                body = await eventually(reported, within=30, what="status.foreignPods to name the pod")
                warnings = [e for e in await events(kube, namespace) if e["reason"] == "ForeignPodInService"]
                assert len(warnings) == 1 and warnings[0]["type"] == "Warning", warnings
                assert FOREIGN in warnings[0]["message"]
                # The client Service selects it (its Endpoints would list it, but not at a loopback IP).
                service = await kube.get("v1", "Service", "demo", namespace)
                assert service["spec"]["selector"].items() <= created["metadata"]["labels"].items()

                # Canary runs after it appeared (the rerun annotation, then the Inconclusive retries):
                # each dials the replicas' IPs, none the foreign pod's, whose name is in no record.
                before = body["status"]["canary"]["runId"]
                annotation = {"metadata": {"annotations": {RERUN_CANARY_ANNOTATION: "foreign"}}}
                await kube.patch_merge(API_VERSION, KIND, "demo", annotation, namespace)

                async def ran_again() -> dict[str, Any] | None:
                    body = await get_serving(kube, namespace)
                    canary = body["status"].get("canary") or {}
                    done = (
                        canary.get("runId") != before and canary.get("target", {}).get("rerun") == "foreign"
                    )
                    return body if done and body["status"]["phase"] == "CanaryInconclusive" else None

                after = await eventually(ran_again, within=60, what="a canary run after the foreign pod")
                status = after["status"]
                own = {f"{name}={pods[name]['metadata']['uid']}" for name in replicas}
                assert set(status["canary"]["target"]["replicaPods"]) == own
                assert status["canary"]["verdict"] == "Inconclusive", status["canary"]
                assert FOREIGN not in {entry["name"] for entry in status["traffic"]["pods"]}
                assert impostor[0].requests == [], "the canary sent a request to the foreign pod"
                still = await kube.get("v1", "Pod", FOREIGN, namespace)
                assert still["metadata"]["labels"][TRAFFIC_LABEL] == TRAFFIC_ON
                assert status["foreignPods"] == [FOREIGN]
                again = [e for e in await events(kube, namespace) if e["reason"] == "ForeignPodInService"]
                assert len(again) == 1, "reported once while it stays, not on every pass"

                await kube.delete("v1", "Pod", FOREIGN, namespace)

                async def cleared() -> bool:
                    return "foreignPods" not in (await get_serving(kube, namespace))["status"]

                await eventually(cleared, within=30, what="status.foreignPods to go with the pod")
