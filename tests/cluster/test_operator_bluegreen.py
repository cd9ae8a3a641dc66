"""BlueGreen rollouts on a real API server: the client Service's Endpoints (written by the real endpoints
controller) switch to the new replica set only after its canary passed, and never on a failure.

Blue pods answer from one fake cluster, the candidate's from another (mapped by the set's name), so the
test decides how the candidate's canary ends. See test_operator_traffic.py for the fake kubelet.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from tests.cluster.operator_harness import (
    FakeKubelet,
    eventually,
    get_serving,
    operator_settings,
    run_operator,
    serving,
    wait_for_phase,
)
from tests.cluster.test_operator_traffic import client_endpoints, endpoints_become, pod_identities
from tests.support.apiserver import ControlPlane
from tests.support.fake_vllm import FakeCluster, Mode

from mooncake_operator.api.group import API_VERSION, KIND
from mooncake_operator.api.resource import parse_resource
from mooncake_operator.build.names import replica_set_name
from mooncake_operator.build.replicas import replica_template_id
from mooncake_operator.kube.client import KubeClient

NODE = "fake-node"
BLUE_IMAGE = "registry.invalid/vllm-mooncake:fixed"
GREEN_IMAGE = "registry.invalid/vllm-mooncake:fixed-2"
BLUE = "demo-replica"


def blue_green(namespace: str, **changes: Any) -> dict[str, Any]:
    return serving(namespace, rollout={"strategy": "BlueGreen"}, **changes)


def candidate_name(namespace: str, image: str) -> str:
    """The set the operator will create for `image` (its pod template digest names it)."""
    resource = parse_resource(blue_green(namespace, engine={"image": image, "blockSize": 32}))
    return replica_set_name(resource, replica_template_id(resource))


async def rollout_of(kube: KubeClient, namespace: str) -> dict[str, Any]:
    return (await get_serving(kube, namespace)).get("status", {}).get("rollout") or {}


async def stateful_set(kube: KubeClient, namespace: str, name: str) -> dict[str, Any] | None:
    return await kube.get_or_none("apps/v1", "StatefulSet", name, namespace)


async def set_pods(kube: KubeClient, namespace: str, replica_set: str) -> set[str]:
    pods = await pod_identities(kube, namespace)
    return {identity for name, identity in pods.items() if name.rsplit("-", 1)[0] == replica_set}


async def serve_blue(kube: KubeClient, namespace: str) -> set[str]:
    await kube.create(blue_green(namespace))
    first = await wait_for_phase(kube, namespace, "Ready")
    assert first["status"]["rollout"] == {"strategy": "BlueGreen", "servingSet": BLUE}
    blue = await set_pods(kube, namespace, BLUE)
    assert len(blue) == 2
    await endpoints_become(kube, namespace, blue, "the first set's proven pods")
    return blue


@contextlib.asynccontextmanager
async def endpoints_seen(kube: KubeClient, namespace: str) -> AsyncIterator[list[tuple[set[str], str]]]:
    """What the client Service's Endpoints listed while the block ran, each with the serving set the
    status named when read just after them (polled every 50 ms)."""
    seen: list[tuple[set[str], str]] = []

    async def poll() -> None:
        while True:
            listed = await client_endpoints(kube, namespace)
            seen.append((listed, (await rollout_of(kube, namespace)).get("servingSet", "")))
            await asyncio.sleep(0.05)

    task = asyncio.create_task(poll())
    try:
        yield seen
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def patch_image(kube: KubeClient, namespace: str, image: str) -> None:
    patch = {"spec": {"engine": {"image": image}}}
    await kube.patch_merge(API_VERSION, KIND, "demo", patch, namespace)


async def test_a_blue_green_rollout_switches_the_client_service_only_after_a_pass(
    kube: KubeClient, kube_cluster: ControlPlane, namespace: str, crd: None, fakes: FakeCluster
) -> None:
    green = candidate_name(namespace, GREEN_IMAGE)
    with FakeCluster.start(2) as green_fakes:
        endpoints = {f"{namespace}/demo": tuple(fakes.urls), f"{namespace}/{green}": tuple(green_fakes.urls)}
        settings = operator_settings(kube_cluster, namespace, replica_endpoints=endpoints)
        with run_operator(settings):
            async with FakeKubelet(kube, namespace, node=NODE) as kubelet:
                blue = await serve_blue(kube, namespace)
                async with endpoints_seen(kube, namespace) as seen:
                    await switch_after_pass(kube, kubelet, namespace, green, blue)
                # The status named the new set before any of its pods was listed (status, then labels),
                # and the Service was never empty (new pods in before old ones out).
                assert seen and all(listed for listed, _ in seen)
                assert all(serving_set == green for listed, serving_set in seen if listed - blue), (
                    "a candidate pod was listed before the status named its set"
                )


async def switch_after_pass(
    kube: KubeClient, kubelet: FakeKubelet, namespace: str, green: str, blue: set[str]
) -> None:
    # The candidate comes up beside the serving set; one of its pods is held not Ready.
    kubelet.hold.add(f"{green}-1")
    await patch_image(kube, namespace, GREEN_IMAGE)

    async def deploying() -> dict[str, Any] | None:
        rollout = await rollout_of(kube, namespace)
        return rollout if rollout.get("candidatePhase") == "Deploying" else None

    rollout = await eventually(deploying, what="the candidate set deploying")
    assert (rollout["servingSet"], rollout["candidateSet"]) == (BLUE, green)
    blue_set = await stateful_set(kube, namespace, BLUE)
    assert blue_set is not None
    assert blue_set["spec"]["template"]["spec"]["containers"][0]["image"] == BLUE_IMAGE
    green_set = await stateful_set(kube, namespace, green)
    assert green_set is not None
    assert green_set["metadata"]["ownerReferences"][0]["kind"] == KIND
    assert await client_endpoints(kube, namespace) == blue

    # Ready, proven, switched: the endpoints list the new set's pods only; the old set goes.
    kubelet.hold.clear()
    passed = await wait_for_phase(kube, namespace, "Ready", within=60)
    assert passed["status"]["canary"]["target"]["generation"] == 2
    new = await set_pods(kube, namespace, green)
    assert set(passed["status"]["canary"]["target"]["replicaPods"]) == new
    await endpoints_become(kube, namespace, new, "the proven candidate's pods")
    assert passed["status"]["rollout"]["servingSet"] == green
    assert "candidateSet" not in passed["status"]["rollout"]

    async def old_set_gone() -> bool:
        return await stateful_set(kube, namespace, BLUE) is None

    await eventually(old_set_gone, what="the old replica set deleted")


async def test_a_failed_blue_green_rollout_never_switches_and_aborts_cleanly(
    kube: KubeClient, kube_cluster: ControlPlane, namespace: str, crd: None, fakes: FakeCluster
) -> None:
    green = candidate_name(namespace, GREEN_IMAGE)
    # The new revision corrupts warm answers: its canary fails.
    with FakeCluster.start(2, modes=[Mode.US_EAST, Mode.US_EAST]) as green_fakes:
        endpoints = {f"{namespace}/demo": tuple(fakes.urls), f"{namespace}/{green}": tuple(green_fakes.urls)}
        settings = operator_settings(kube_cluster, namespace, replica_endpoints=endpoints)
        with run_operator(settings):
            async with FakeKubelet(kube, namespace, node=NODE):
                blue = await serve_blue(kube, namespace)
                async with endpoints_seen(kube, namespace) as seen:
                    await fail_then_roll_back(kube, namespace, green, blue)
                assert seen and all(listed == blue for listed, _ in seen), "only the old set ever served"


async def fail_then_roll_back(kube: KubeClient, namespace: str, green: str, blue: set[str]) -> None:
    await patch_image(kube, namespace, GREEN_IMAGE)

    # Hold (the default): the candidate is kept for inspection, the old set keeps serving.
    async def held() -> dict[str, Any] | None:
        body = await get_serving(kube, namespace)
        rollout = body["status"].get("rollout") or {}
        return body if rollout.get("candidatePhase") == "Held" else None

    body = await eventually(held, within=60, what="the candidate held after its failure")
    assert body["status"]["phase"] == "CanaryFailed"
    assert body["status"]["canary"]["verdict"] == "Failed"
    rollout = body["status"]["rollout"]
    assert (rollout["servingSet"], rollout["candidateSet"]) == (BLUE, green)
    assert green in rollout["message"]
    assert await client_endpoints(kube, namespace) == blue
    assert await stateful_set(kube, namespace, green) is not None
    green_pods = await set_pods(kube, namespace, green)
    assert len(green_pods) == 2
    assert set(body["status"]["canary"]["target"]["replicaPods"]) == green_pods

    # Rollback: the next failure removes the candidate; the old set never stopped serving.
    patch = {"spec": {"canary": {"onFailure": "Rollback"}}}
    await kube.patch_merge(API_VERSION, KIND, "demo", patch, namespace)

    async def candidate_removed() -> dict[str, Any] | None:
        rollout = await rollout_of(kube, namespace)
        gone = await stateful_set(kube, namespace, green) is None
        return rollout if gone and "candidateSet" not in rollout else None

    rollout = await eventually(candidate_removed, within=60, what="the candidate removed")
    assert rollout["servingSet"] == BLUE
    assert await client_endpoints(kube, namespace) == blue
    assert await set_pods(kube, namespace, BLUE) == blue
