"""User traffic on a real API server: the client Service's Endpoints (written by the real endpoints
controller) list a replica pod only after a canary proved it at its pod template.

`FakeKubelet(node=...)` binds pods to an absent node and gives them documentation-range IPs so that the
endpoints controller lists them; Endpoints name each address's pod (`targetRef`), which tells a new pod
from the one it replaced.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from tests.cluster.operator_harness import (
    FakeKubelet,
    condition,
    eventually,
    get_serving,
    replica_pods,
    run_operator,
    serving,
    wait_for_phase,
)
from tests.support.fake_vllm import FakeCluster, Mode

from mooncake_operator.api.group import API_VERSION, KIND
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.runtime.settings import OperatorSettings

NODE = "fake-node"
NEVER_LOADS = "registry.invalid/vllm-mooncake:never-loads"  # its canary is Inconclusive: no external hit
FIXED_2 = "registry.invalid/vllm-mooncake:fixed-2"


async def client_endpoints(kube: KubeClient, namespace: str) -> set[str]:
    """`name=uid` of every pod the client Service routes to (ready or not)."""
    endpoints = await kube.get_or_none("v1", "Endpoints", "demo", namespace)
    found = set()
    for subset in (endpoints or {}).get("subsets") or []:
        for address in [*(subset.get("addresses") or []), *(subset.get("notReadyAddresses") or [])]:
            ref = address.get("targetRef") or {}
            found.add(f"{ref.get('name')}={ref.get('uid')}")
    return found


POOL_CRD = Path(__file__).parent / "data" / "inferencepool-crd.yaml"
POOL_API = "inference.networking.k8s.io/v1"
PICKER = {"endpointPicker": {"name": "demo-epp", "port": 9002}}


async def install_pool_crd(kube: KubeClient) -> None:
    """The InferencePool CRD this tier's API server lacks (written from the v1 API reference)."""
    await kube.apply(yaml.safe_load(POOL_CRD.read_text(encoding="utf-8")), field_manager="operator-tests")

    async def served() -> bool:
        return "v1" in await kube.served_versions("inference.networking.k8s.io")

    await eventually(served, what="InferencePools served")


async def pool_members(kube: KubeClient, namespace: str) -> set[str]:
    """`name=uid` of every pod the InferencePool `demo` selects: what an endpoint picker may route to
    (it also asks for Ready, which these fake pods always are once running)."""
    pool = await kube.get(POOL_API, "InferencePool", "demo", namespace)
    labels = pool["spec"]["selector"]["matchLabels"]
    selector = ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
    pods = await kube.list("v1", "Pod", namespace, label_selector=selector)
    return {
        f"{p['metadata']['name']}={p['metadata']['uid']}"
        for p in pods
        if not p["metadata"].get("deletionTimestamp")
    }


async def pod_identities(kube: KubeClient, namespace: str) -> dict[str, str]:
    return {
        p["metadata"]["name"]: f"{p['metadata']['name']}={p['metadata']['uid']}"
        for p in await replica_pods(kube, namespace)
    }


async def endpoints_become(
    kube: KubeClient, namespace: str, wanted: set[str], what: str, *, pool: bool = False
) -> None:
    """The client Service's endpoints become `wanted`, and with `pool` the InferencePool's members too
    (the same proof gate; the resource sets spec.inferencePool and the test installed its CRD)."""

    async def members() -> set[str] | None:
        return await pool_members(kube, namespace) if pool else None

    async def probe() -> bool:
        endpoints = await client_endpoints(kube, namespace)
        return endpoints == wanted and (not pool or await members() == wanted)

    try:
        await eventually(probe, within=30, what=what)
    except AssertionError as error:
        endpoints = await client_endpoints(kube, namespace)
        raise AssertionError(f"{error}; endpoints: {endpoints}; pool members: {await members()}") from None


async def patch_image(kube: KubeClient, namespace: str, image: str) -> None:
    patch = {"spec": {"engine": {"image": image}}}
    await kube.patch_merge(API_VERSION, KIND, "demo", patch, namespace)


async def settled_at(kube: KubeClient, namespace: str, generation: int, phase: str) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        body = await get_serving(kube, namespace)
        status = body.get("status") or {}
        target = (status.get("canary") or {}).get("target") or {}
        done = status.get("phase") == phase and target.get("generation") == generation
        return body if done else None

    return await eventually(probe, within=60, what=f"phase {phase} at generation {generation}")


async def test_new_pods_join_the_client_endpoints_only_after_a_pass_and_inconclusive_keeps_them_out(
    kube: KubeClient, namespace: str, crd: None, fakes: FakeCluster, settings: OperatorSettings
) -> None:
    modes = {NEVER_LOADS: Mode.NEVER_LOADS}
    await install_pool_crd(kube)
    with run_operator(settings):
        async with FakeKubelet(kube, namespace, fakes=fakes, modes_by_image=modes, node=NODE) as kubelet:
            await kube.create(serving(namespace, inferencePool=PICKER))
            first = await wait_for_phase(kube, namespace, "Ready")
            assert first["status"]["traffic"]["serving"] == 2
            # The proof-gated InferencePool: the client Service's selector, the engine port, the
            # endpoint picker named, FailClose unless asked otherwise, owned by the resource.
            pool = await kube.get(POOL_API, "InferencePool", "demo", namespace)
            assert pool["spec"]["selector"]["matchLabels"]["serving.mooncake-operator.dev/traffic"] == "on"
            client = await kube.get("v1", "Service", "demo", namespace)
            assert pool["spec"]["selector"]["matchLabels"] == client["spec"]["selector"]
            assert pool["spec"]["targetPorts"] == [{"number": first["spec"]["engine"]["port"]}]
            picker = pool["spec"]["endpointPickerRef"]
            assert (picker["name"], picker["port"], picker["failureMode"]) == (
                "demo-epp",
                {"number": 9002},
                "FailClose",
            )
            assert pool["metadata"]["ownerReferences"][0]["kind"] == KIND
            proven = await pod_identities(kube, namespace)
            await endpoints_become(
                kube, namespace, set(proven.values()), "both proven pods in the endpoints", pool=True
            )

            # In place: replica 1 leaves the endpoints, then is replaced (held not Ready), and a surge
            # replica 2 of the new template starts beside it; replica 0, proven, keeps serving.
            kubelet.hold.add("demo-replica-1")
            await patch_image(kube, namespace, NEVER_LOADS)

            async def replaced() -> dict[str, str] | None:
                now = await pod_identities(kube, namespace)
                fresh = now.get("demo-replica-1") not in (None, proven["demo-replica-1"])
                return now if fresh else None

            mid = await eventually(replaced, what="replica 1 replaced")
            await endpoints_become(
                kube, namespace, {proven["demo-replica-0"]}, "only the proven pod", pool=True
            )
            new_uid = mid["demo-replica-1"].split("=")[1]

            async def recorded() -> dict[str, dict[str, Any]] | None:
                body = await get_serving(kube, namespace)
                entries = {entry["name"]: entry for entry in body["status"]["traffic"]["pods"]}
                return entries if entries.get("demo-replica-1", {}).get("uid") == new_uid else None

            entries = await eventually(recorded, what="the status to record the new replica 1")
            assert entries["demo-replica-0"]["serving"] is True
            assert entries["demo-replica-0"]["uid"] == proven["demo-replica-0"].split("=")[1]
            assert entries["demo-replica-1"]["serving"] is False
            assert entries["demo-replica-1"]["reason"].startswith("new pod at pod template")

            # The new pods' canary is Inconclusive: neither serves, and the rollout goes no further, so
            # the proven old replica 0 keeps serving alone.
            kubelet.hold.clear()
            inconclusive = await settled_at(kube, namespace, 2, "CanaryInconclusive")
            assert condition(inconclusive, "Ready")["reason"] == "CanaryInconclusive"
            new = await pod_identities(kube, namespace)
            assert set(new.values()) & set(proven.values()) == {proven["demo-replica-0"]}
            assert sorted(new) == ["demo-replica-0", "demo-replica-1", "demo-replica-2"]
            await endpoints_become(
                kube, namespace, {proven["demo-replica-0"]}, "only the old proven pod", pool=True
            )
            traffic = inconclusive["status"]["traffic"]
            assert traffic["serving"] == 1
            unproven = [entry for entry in traffic["pods"] if entry["name"] != "demo-replica-0"]
            assert unproven and all("Inconclusive" in entry["reason"] for entry in unproven), traffic
            # Retried (inconclusive-retry-seconds) and still inconclusive: still out.
            retried = await eventually(
                lambda: _another_run(kube, namespace, inconclusive), what="an inconclusive retry"
            )
            assert retried["status"]["traffic"]["serving"] == 1
            assert await client_endpoints(kube, namespace) == {proven["demo-replica-0"]}

            # A revision that passes: its pods join the endpoints once proven, the last old pod is
            # replaced after them, and the surge goes.
            await patch_image(kube, namespace, FIXED_2)
            passed = await settled_at(kube, namespace, 3, "Ready")
            final = await pod_identities(kube, namespace)
            assert sorted(final) == ["demo-replica-0", "demo-replica-1"]
            assert final["demo-replica-0"] != proven["demo-replica-0"]
            # The last run proved the two pods that stay and the surge pod removed after it.
            assert set(passed["status"]["canary"]["target"]["replicaPods"]) > set(final.values())
            await endpoints_become(kube, namespace, set(final.values()), "the proven new pods", pool=True)
            assert passed["status"]["traffic"]["serving"] == 2

            # Unset: the pool goes (a gateway must not keep routing through it).
            await kube.patch_merge(API_VERSION, KIND, "demo", {"spec": {"inferencePool": None}}, namespace)

            async def pool_gone() -> bool:
                return await kube.get_or_none(POOL_API, "InferencePool", "demo", namespace) is None

            await eventually(pool_gone, what="the InferencePool removed")


async def _another_run(kube: KubeClient, namespace: str, before: dict[str, Any]) -> dict[str, Any] | None:
    body = await get_serving(kube, namespace)
    canary = body["status"].get("canary") or {}
    done = (
        canary.get("runId") != before["status"]["canary"]["runId"] and canary.get("verdict") == "Inconclusive"
    )
    return body if done and body["status"]["phase"] == "CanaryInconclusive" else None
