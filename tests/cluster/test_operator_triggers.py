"""When the canary runs again: a replaced replica pod, a restarted master, the spec's interval (so Ready can
go back to False with no change to the resource); and the operator's metrics and liveness endpoints."""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
from tests.cluster.operator_harness import (
    FakeKubelet,
    RunningOperator,
    condition,
    eventually,
    get_serving,
    replica_pods,
    run_operator,
    serving,
    wait_for_phase,
)
from tests.support.apiserver import free_port
from tests.support.fake_vllm import FakeCluster, Mode

from mooncake_operator.api.group import API_VERSION, KIND
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.runtime.settings import OperatorSettings


def runs(fakes: FakeCluster) -> float:
    """Canary runs so far: each sends two requests (cold, warm) per pair, two pairs per run (a run in
    progress counts as a fraction)."""
    return sum(len(replica.requests_to("/v1/chat/completions")) for replica in fakes.replicas) / 4


async def proven(kube: KubeClient, namespace: str, fakes: FakeCluster, count: int) -> dict[str, Any]:
    """Waits for the `count`-th canary run to be reported Ready."""

    async def probe() -> dict[str, Any] | None:
        body = await get_serving(kube, namespace)
        return body if runs(fakes) == count and body["status"].get("phase") == "Ready" else None

    return await eventually(probe, within=30, what=f"canary run {count} reported Ready")


async def test_replaced_pods_a_restarted_master_and_the_interval_rerun_the_canary(
    kube: KubeClient, namespace: str, fakes: FakeCluster, operator: RunningOperator
) -> None:
    async with FakeKubelet(kube, namespace) as kubelet:
        await kube.create(serving(namespace))
        first = await proven(kube, namespace, fakes, 1)

        # A replica pod replaced (its StatefulSet recreates it under the same name, new UID).
        old = (await replica_pods(kube, namespace))[0]
        await kube.delete("v1", "Pod", old["metadata"]["name"], namespace)
        second = await proven(kube, namespace, fakes, 2)
        replaced = second["status"]["canary"]["target"]["replicaPods"][0]
        assert replaced.startswith("demo-replica-0=") and old["metadata"]["uid"] not in replaced
        assert first["status"]["canary"]["runId"] != second["status"]["canary"]["runId"]

        # The store master's container restarted (same pod, higher restart count).
        master = (
            await kube.list("v1", "Pod", namespace, label_selector="app.kubernetes.io/component=store-master")
        )[0]
        await kubelet.restart_container(master["metadata"]["name"])
        third = await proven(kube, namespace, fakes, 3)
        assert third["status"]["canary"]["target"]["masterRestarts"] == 1

        # An interval: a new revision runs at once, then again every interval, level-based.
        await kube.patch_merge(
            API_VERSION, KIND, "demo", {"spec": {"canary": {"intervalSeconds": 2}}}, namespace
        )
        await proven(kube, namespace, fakes, 4)
        await proven(kube, namespace, fakes, 5)

        # Replica 1 starts corrupting: the next interval's run takes Ready back to False,
        # though nothing in the resource changed.
        generation = third["metadata"]["generation"] + 1
        fakes[1].mode = Mode.US_EAST
        failed = await wait_for_phase(kube, namespace, "CanaryFailed")
        assert failed["metadata"]["generation"] == generation
        ready = condition(failed, "Ready")
        assert (ready["status"], ready["reason"]) == ("False", "CanaryFailed")
        assert failed["status"]["outOfTraffic"] == ["demo-replica-1"]


async def test_metrics_and_liveness_are_served(
    kube: KubeClient, namespace: str, crd: None, fakes: FakeCluster, settings: OperatorSettings
) -> None:
    settings = dataclasses.replace(
        settings,
        metrics_host="127.0.0.1",
        metrics_port=free_port(),
        liveness_host="127.0.0.1",
        liveness_port=free_port(),
    )
    with run_operator(settings):
        async with FakeKubelet(kube, namespace):
            await kube.create(serving(namespace))
            await wait_for_phase(kube, namespace, "Ready")
        async with httpx.AsyncClient(trust_env=False) as http:

            async def counted() -> dict[str, float] | None:
                # A pass writes Ready to the resource, then counts its outcome: a scrape between the
                # two sees the resource Ready and its reconcile not yet counted.
                text = (await http.get(f"http://127.0.0.1:{settings.metrics_port}/metrics")).text
                parsed = {
                    line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line and not line.startswith("#")
                }
                ready = parsed.get('mooncake_operator_reconciles_total{result="ready"}', 0.0)
                return parsed if ready >= 1 else None

            samples = await eventually(counted, within=10, what="the Ready reconcile counted")
            liveness = await http.get(f"http://127.0.0.1:{settings.liveness_port}/healthz")
    assert liveness.status_code == 200
    assert samples['mooncake_operator_canary_runs_total{verdict="Passed"}'] == 1
    assert samples['mooncake_operator_canary_runs_total{verdict="Failed"}'] == 0
    assert samples["mooncake_operator_canary_duration_seconds_count"] == 1
    assert (
        samples[f'mooncake_operator_canary_external_hit_tokens{{name="demo",namespace="{namespace}"}}'] == 256
    )
    assert samples[f'mooncake_operator_ready{{name="demo",namespace="{namespace}"}}'] == 1
    assert samples['mooncake_operator_kube_requests_total{verb="apply"}'] == 10  # nine children, last good
