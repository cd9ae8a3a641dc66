"""The reconcile's edges without a cluster: a resource that is gone, an API server that fails."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from mooncake_operator.kube import KubeClient, KubeConfig
from mooncake_operator.operator_settings import OperatorSettings
from mooncake_operator.reconcile import ReconcileResult, Runtime, reconcile

pytestmark = pytest.mark.unit


def runtime_answering(handler: Callable[[httpx.Request], httpx.Response]) -> Runtime:
    """A runtime whose watches find nothing and whose every other request `handler` answers."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.params.get("watch") == "true":
            return httpx.Response(200, content=b"")
        if request.url.params.get("limit"):  # the watch cache's first list
            return httpx.Response(200, json={"items": [], "metadata": {"resourceVersion": "1"}})
        return handler(request)

    config = KubeConfig(server="https://127.0.0.1:6443", token="t")
    kube = KubeClient(config, transport=httpx.MockTransport(answer))
    return Runtime.start(OperatorSettings(kube=config, retry_delay_seconds=3, metrics_port=0), kube)


@pytest.fixture
async def closing() -> AsyncIterator[list[Runtime]]:
    runtimes: list[Runtime] = []
    yield runtimes
    for runtime in runtimes:
        await runtime.close()


def errors(runtime: Runtime) -> float | None:
    return runtime.metrics.registry.get_sample_value(
        "mooncake_operator_reconciles_total", {"result": "error"}
    )


async def test_a_deleted_resource_needs_nothing(closing: list[Runtime]) -> None:
    status = {"kind": "Status", "reason": "NotFound", "message": "not found", "code": 404}
    runtime = runtime_answering(lambda request: httpx.Response(404, json=status))
    closing.append(runtime)
    outcome = await reconcile(runtime, "ns", "demo")
    assert outcome.result is ReconcileResult.GONE and outcome.retry_after is None
    assert runtime.kube.counts.writes == 0


async def test_an_api_failure_is_retried_soon_and_counted(closing: list[Runtime]) -> None:
    status = {"kind": "Status", "reason": "InternalError", "message": "etcdserver: timeout", "code": 500}
    runtime = runtime_answering(lambda request: httpx.Response(500, json=status))
    closing.append(runtime)
    outcome = await reconcile(runtime, "ns", "demo")
    assert outcome.result is ReconcileResult.ERROR
    assert outcome.retry_after == 3
    assert "etcdserver: timeout" in outcome.message
    assert errors(runtime) == 1
