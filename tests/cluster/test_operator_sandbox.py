"""The operator with its replicas mapped to the sandbox's real engines (real mooncake_master, two real vLLM
CPU replicas, tiny target + Eagle-3 draft): Ready on the patched engine, CanaryFailed on the buggy one.

Marked `cluster` (real API server) and `e2e` (real engines). Like the e2e tier it must run inside a
loopback-only network namespace (the engines' store clients listen on 0.0.0.0); it fails, never skips,
elsewhere. The resource is the customer's spec with the sandbox's block size and content checks off (the
tiny model does not know the customer's answer; cold/warm equality and the external hit still decide).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from tests.cluster.operator_harness import (
    FakeKubelet,
    condition,
    get_serving,
    install_crd,
    operator_settings,
    run_operator,
    wait_for_phase,
)
from tests.support.apiserver import ControlPlane
from tests.support.cpu_stalls import (  # noqa: F401 (fixtures: watch this module's tests)
    cpu_stall_monitor,
    cpu_stall_watch,
    stalled_during_test,
)

from mooncake_operator.api.group import API_VERSION, KIND, RERUN_CANARY_ANNOTATION
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.reconcile.decide.status import without_empty_strings
from mooncake_sandbox import (
    EngineMode,
    Sandbox,
    SandboxOptions,
    prepare,
    sandbox_spec,
    start_sandbox,
)
from mooncake_sandbox.netns import in_private_netns

# Rerun (at most once, reported by pytest) only when a CPU of this machine stalled while the test ran
# (tests/support/cpu_stalls.py, docs/sandbox.md): such a stall shows up as a store transfer failing
# with HTTP 500, or as the harness's API server not answering in time; a wrong verdict fails at once.
# Slow (scripts/test-slow): the node tier proves both outcomes on real pods (patched Ready with an external
# hit, buggy CanaryFailed and out of traffic: tests/node/test_product_on_a_node.py).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.e2e,
    pytest.mark.timeout(1800),
    pytest.mark.flaky(reruns=1, condition=stalled_during_test),
]

RUN_IN_NETNS = (
    ".venv/bin/python -m mooncake_sandbox.netns -- "
    ".venv/bin/python -m pytest tests/cluster/test_operator_sandbox.py"
)
CANARY_TIMEOUT_S = 300


@pytest_asyncio.fixture
async def sandbox(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Sandbox]:
    if not in_private_netns():
        pytest.fail(
            "this test starts real engines whose store clients listen on 0.0.0.0; run it in a loopback-only "
            f"network namespace: {RUN_IN_NETNS}  (scripts/test does this for every tier)"
        )
    prepared = prepare((EngineMode.PATCHED, EngineMode.BUGGY), log=lambda line: print(f"prepare: {line}"))
    options = SandboxOptions(
        replicas=2, engine=EngineMode.PATCHED, run_dir=tmp_path_factory.mktemp("sandbox")
    )
    async with start_sandbox(options, prepared=prepared) as running:
        yield running


def sandbox_resource(namespace: str, block_size: int) -> dict[str, Any]:
    # Empty strings left out: unpatched 1.20 API servers read "" in a custom resource as null (k/k#99804).
    spec = without_empty_strings(sandbox_spec(speculative=True).to_wire())
    spec["engine"]["blockSize"] = block_size
    # The customer's request only (suite []): this proves the operator's flow on real engines; the
    # block-boundary suite is proven on them by tests/e2e/test_customer_reproduction.py.
    spec["canary"] = {
        "expectations": [],
        "timeoutSeconds": CANARY_TIMEOUT_S,
        "onFailure": "Hold",
        "suite": [],
    }
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": "demo", "namespace": namespace},
        "spec": spec,
    }


async def test_ready_with_the_patched_engine_canary_failed_with_the_buggy_one(
    kube: KubeClient, kube_cluster: ControlPlane, namespace: str, sandbox: Sandbox
) -> None:
    await install_crd(kube)
    endpoints = {f"{namespace}/demo": tuple(sandbox.replica_urls)}
    settings = operator_settings(kube_cluster, namespace, replica_endpoints=endpoints)
    with run_operator(settings):
        async with FakeKubelet(kube, namespace):
            await kube.create(sandbox_resource(namespace, sandbox.block_size))
            ready = await wait_for_phase(kube, namespace, "Ready", within=2 * CANARY_TIMEOUT_S)
            canary = ready["status"]["canary"]
            assert canary["verdict"] == "Passed"
            for pair in canary["pairs"]:
                assert pair["answersEqual"] is True
                assert pair["externalHitTokens"] == pair["expectedExternalHitTokens"] > 0
                assert pair["loadGetKeys"] * sandbox.block_size == pair["externalHitTokens"]

            # The same replicas on the engine without the fix; a re-run is asked for.
            await sandbox.restart_replicas([0, 1], engine=EngineMode.BUGGY)
            await kube.patch_merge(
                API_VERSION,
                KIND,
                "demo",
                {"metadata": {"annotations": {RERUN_CANARY_ANNOTATION: "buggy-engine"}}},
                namespace,
            )
            failed = await wait_for_phase(kube, namespace, "CanaryFailed", within=2 * CANARY_TIMEOUT_S)
        ready_condition = condition(failed, "Ready")
        assert (ready_condition["status"], ready_condition["reason"]) == ("False", "CanaryFailed")
        pairs = failed["status"]["canary"]["pairs"]
        wrong = [pair for pair in pairs if pair["verdict"] == "Failed"]
        assert wrong, pairs
        for pair in wrong:
            assert pair["answersEqual"] is False and "firstMismatch" in pair
            # The connector loaded one block less than the scheduler counted: the bug's signature.
            assert pair["loadGetKeys"] * sandbox.block_size < pair["externalHitTokens"]
            assert any("double-prune" in note for note in pair["notes"])
        assert failed["status"]["outOfTraffic"] == sorted({pair["reader"] for pair in wrong})
        body = await get_serving(kube, namespace)
        assert body["status"]["lastGoodRevision"] == body["status"]["servingRevision"]
