"""The reconcile's edges without a cluster: a resource that is gone, an API server that fails."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from mooncake_operator.crd import SERVING_KIND
from mooncake_operator.examples import customer_deployment
from mooncake_operator.kube import KubeClient, KubeConfig
from mooncake_operator.metrics import OperatorMetrics
from mooncake_operator.operator_settings import OperatorSettings
from mooncake_operator.reconcile import ReconcileResult, Runtime, reconcile

pytestmark = pytest.mark.unit


def runtime_answering(handler: Callable[[httpx.Request], httpx.Response]) -> Runtime:
    config = KubeConfig(server="https://127.0.0.1:6443", token="t")
    kube = KubeClient(config, transport=httpx.MockTransport(handler), kinds=[SERVING_KIND])
    settings = OperatorSettings(kube=config, retry_delay_seconds=3)
    return Runtime(settings=settings, kube=kube, http=httpx.AsyncClient(), metrics=OperatorMetrics())


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


def _demo_resource() -> dict[str, Any]:
    resource = customer_deployment().to_wire()
    resource["metadata"] = {"name": "demo", "namespace": "ns", "uid": "u-1", "generation": 1}
    return resource


@pytest.mark.parametrize(
    ("code", "reason", "message"),
    [
        (409, "Conflict", 'Apply failed with 1 conflict: conflict with "kubectl": .spec.replicas'),
        (422, "Invalid", 'StatefulSet.apps "demo-replica" is invalid: spec.template: Forbidden'),
        (500, "InternalError", "etcdserver: request timed out"),
    ],
)
async def test_an_apply_the_api_server_refuses_is_a_condition(
    code: int, reason: str, message: str, closing: list[Runtime]
) -> None:
    resource = _demo_resource()
    status_patches: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "GET" and path.endswith("/mooncakeservings/demo"):
            return httpx.Response(200, json=resource)
        if request.method == "GET":
            return httpx.Response(404, json={"kind": "Status", "reason": "NotFound", "code": 404})
        if request.method == "PATCH" and path.endswith("/status"):
            status_patches.append(json.loads(request.content))
            return httpx.Response(200, json=resource)
        if request.method == "PATCH" and "/statefulsets/" in path:
            return httpx.Response(
                code, json={"kind": "Status", "reason": reason, "message": message, "code": code}
            )
        return httpx.Response(200, json=json.loads(request.content or b"{}"))

    runtime = runtime_answering(handler)
    closing.append(runtime)
    outcome = await reconcile(runtime, "ns", "demo")
    assert outcome.result is ReconcileResult.ERROR
    assert outcome.retry_after == 3
    conditions = {c["type"]: c for c in status_patches[-1]["status"]["conditions"]}
    ready = conditions["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "ApplyFailed")
    assert "StatefulSet/demo-replica" in ready["message"]
    assert f"HTTP {code}" in ready["message"] and message in ready["message"]


@pytest.mark.parametrize(
    ("path", "value"),
    [("limits", {"memory": "1e999999999"}), ("requests", {"memory": "9" * 5000 + "Gi"})],
)
async def test_absurd_quantities_are_invalid_not_retried_exceptions(
    path: str, value: dict[str, str], closing: list[Runtime]
) -> None:
    resource = _demo_resource()
    resource["spec"]["engine"]["resources"] = {path: value}
    status_patches: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json=resource)
        if request.url.path.endswith("/status"):
            status_patches.append(json.loads(request.content))
        return httpx.Response(200, json=resource)

    runtime = runtime_answering(handler)
    closing.append(runtime)
    outcome = await reconcile(runtime, "ns", "demo")
    assert outcome.result is ReconcileResult.INVALID
    assert status_patches[-1]["status"]["phase"] == "Invalid"
    assert "too large" in outcome.message
