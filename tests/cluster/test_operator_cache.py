"""The watch cache on a real API server: edits racing a reconcile whose cache is behind cannot be undone
by it, and events on children (deleted, edited) reach the owner's reconcile with the resync 10 minutes off.

A stale cache is made for real: the reconcile runs on a `Runtime` whose watches were stopped (its stores
keep what they had), while the edits go to the API server.
"""

from __future__ import annotations

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
from tests.support.apiserver import ControlPlane

from mooncake_operator.api.group import API_VERSION, KIND
from mooncake_operator.api.resource import parse_resource
from mooncake_operator.build.digests import spec_hash
from mooncake_operator.build.names import ChildNames
from mooncake_operator.build.store_config import STORE_CONFIG_KEY
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.reconcile.act.core import Runtime, reconcile
from mooncake_operator.runtime.settings import OperatorSettings

NEW_IMAGE = "registry.invalid/vllm-mooncake:newer"


async def started_runtime(plane: ControlPlane, namespace: str) -> Runtime:
    runtime = Runtime.start(operator_settings(plane, namespace))
    await runtime.cache.wait_synced()
    return runtime


async def cached(runtime: Runtime, namespace: str, kind: tuple[str, str], name: str) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        return runtime.cache.get(*kind, namespace, name)

    return await eventually(probe, within=10, what=f"{kind[1]}/{name} in the cache")


def replica_image(stateful_set: dict[str, Any]) -> str:
    image: str = stateful_set["spec"]["template"]["spec"]["containers"][0]["image"]
    return image


async def test_a_spec_edit_racing_a_reconcile_is_not_undone_by_its_stale_status_write(
    kube: KubeClient, kube_cluster: ControlPlane, namespace: str, crd: None
) -> None:
    runtime = await started_runtime(kube_cluster, namespace)
    try:
        seen = await kube.create(serving(namespace))
        runtime.cache.record("ADDED", seen)  # what kopf's watch hands the cache (no kopf runs here)
        await runtime.cache.close()  # from here on the cache is behind the API server
        edit = {"spec": {"engine": {"image": NEW_IMAGE}}}
        edited = await kube.patch_merge(API_VERSION, KIND, "demo", edit, namespace)
        assert edited["metadata"]["generation"] == seen["metadata"]["generation"] + 1

        await runtime.policy_api_version()  # discovery, once per process: not part of what is counted
        before = runtime.kube.counts.snapshot()
        await reconcile(runtime, namespace, "demo")
        calls = runtime.kube.counts.since(before).by_verb

        # The status computed from the stale copy carried its resourceVersion and was refused; the
        # reconcile read the resource once and wrote the status of the edited spec.
        assert calls["patch_status"] == 2 and calls["get"] == 1, calls
        body = await get_serving(kube, namespace)
        assert body["status"]["observedGeneration"] == edited["metadata"]["generation"]
        spec = parse_resource({**body, "status": None}).spec
        assert body["status"]["desiredRevision"] == spec_hash(spec)
        names = ChildNames.of("demo")
        stateful_set = await kube.get("apps/v1", "StatefulSet", names.replicas, namespace)
        assert replica_image(stateful_set) == NEW_IMAGE
    finally:
        await runtime.close()


async def test_an_apply_from_a_stale_child_keeps_what_others_own_on_it(
    kube: KubeClient, kube_cluster: ControlPlane, namespace: str, crd: None
) -> None:
    names = ChildNames.of("demo")
    runtime = await started_runtime(kube_cluster, namespace)
    try:
        await kube.create(serving(namespace))
        await reconcile(runtime, namespace, "demo")
        await cached(runtime, namespace, ("apps/v1", "StatefulSet"), names.replicas)
        await runtime.cache.close()

        # Someone else's edits the cache never sees: a label and an annotation they own.
        mine = {"metadata": {"labels": {"team": "inference"}, "annotations": {"example.com/owner": "ops"}}}
        await kube.patch_merge("apps/v1", "StatefulSet", names.replicas, mine, namespace, field_manager="ops")
        # The spec changes; the cache learns it (as if its watch delivered only that event).
        await kube.patch_merge(
            API_VERSION, KIND, "demo", {"spec": {"engine": {"image": NEW_IMAGE}}}, namespace
        )
        runtime.cache.remember(await get_serving(kube, namespace))

        await reconcile(runtime, namespace, "demo")
        stateful_set = await kube.get("apps/v1", "StatefulSet", names.replicas, namespace)
        assert replica_image(stateful_set) == NEW_IMAGE
        assert stateful_set["metadata"]["labels"]["team"] == "inference"
        assert stateful_set["metadata"]["annotations"]["example.com/owner"] == "ops"
    finally:
        await runtime.close()


async def test_a_deleted_or_edited_child_is_restored_at_once_without_a_resync(
    kube: KubeClient, namespace: str, crd: None, settings: OperatorSettings
) -> None:
    names = ChildNames.of("demo")
    assert settings.resync_seconds >= 600
    with run_operator(settings) as operator:
        async with FakeKubelet(kube, namespace):
            await kube.create(serving(namespace))
            await wait_for_phase(kube, namespace, "Ready")
        before = operator.runtime.kube.counts.snapshot()

        await kube.delete("v1", "Service", names.client_service, namespace)

        async def recreated() -> dict[str, Any] | None:
            return await kube.get_or_none("v1", "Service", names.client_service, namespace)

        await eventually(recreated, within=10, what="the deleted client Service recreated")

        drift = {"data": {STORE_CONFIG_KEY: "{}"}}
        await kube.patch_merge("v1", "ConfigMap", names.store_config, drift, namespace, field_manager="ops")

        async def restored() -> bool:
            config_map = await kube.get("v1", "ConfigMap", names.store_config, namespace)
            return bool(config_map["data"][STORE_CONFIG_KEY] != "{}")

        await eventually(restored, within=10, what="the edited store config put back")
        reacted = operator.runtime.kube.counts.since(before)
        assert reacted.reads == 0, reacted.by_verb  # the watch told it; nothing was polled
