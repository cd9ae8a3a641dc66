"""Issue 21, Medium 9: a tenant's MooncakeServing cannot join another namespace's network attachments,
and asks for privileged or host-network replicas only where the operator's administrator allows them:
otherwise the resource is Invalid, the field named, and nothing is applied."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from tests.support.fake_api import runtime_answering
from tests.unit.test_gpu_pods import example, rdma_example, with_rdma

from mooncake_operator.api.resource import InvalidResourceError, parse_resource
from mooncake_operator.reconcile.act.core import reconcile
from mooncake_operator.reconcile.decide.actions import ReconcileResult
from mooncake_operator.runtime.settings import OperatorSettings

pytestmark = pytest.mark.unit


def in_namespace(obj: dict[str, Any], namespace: str) -> dict[str, Any]:
    return {**obj, "metadata": {**obj["metadata"], "namespace": namespace}}


def problems_of(obj: dict[str, Any]) -> list[str]:
    with pytest.raises(InvalidResourceError) as caught:
        parse_resource(obj)
    return caught.value.problems


@pytest.mark.parametrize(
    "networks",
    [
        "tenant-b/rdma-net",
        "rdma-net, tenant-b/rdma-net@net1",
        json.dumps([{"name": "rdma-net"}, {"name": "rdma-net", "namespace": "tenant-b"}]),
    ],
)
def test_a_network_attachment_of_another_namespace_is_refused(networks: str) -> None:
    obj = in_namespace(with_rdma(example(), {"resourceName": "rdma/ib", "networks": networks}), "tenant-a")
    problems = problems_of(obj)
    assert any("spec.store.rdma.networks" in p and "'tenant-b'" in p for p in problems), problems


@pytest.mark.parametrize(
    "networks",
    ["rdma-net", "tenant-a/rdma-net@net1, other-net", json.dumps([{"name": "n", "namespace": "tenant-a"}])],
)
def test_attachments_of_the_own_namespace_are_accepted(networks: str) -> None:
    obj = in_namespace(with_rdma(example(), {"resourceName": "rdma/ib", "networks": networks}), "tenant-a")
    assert parse_resource(obj).spec.store.rdma is not None


def test_an_unreadable_json_networks_value_is_refused() -> None:
    obj = with_rdma(example(), {"resourceName": "rdma/ib", "networks": '[{"name": "n"'})
    assert any("store.rdma.networks is not a valid JSON list" in p for p in problems_of(obj))


def test_the_rdma_example_needs_no_node_level_permission() -> None:
    assert OperatorSettings().refused_options(parse_resource(rdma_example()).spec) == []


@pytest.mark.parametrize(
    ("rdma", "allowed", "named"),
    [
        ({"hostDevices": True}, {}, "spec.store.rdma.hostDevices"),
        ({"resourceName": "rdma/ib", "hostNetwork": True}, {}, "spec.store.rdma.hostNetwork"),
        ({"hostDevices": True, "hostNetwork": True}, {"allow_host_network": True}, "hostDevices"),
        ({"hostDevices": True, "hostNetwork": True}, {"allow_privileged_engines": True}, "hostNetwork"),
    ],
)
def test_node_level_options_need_the_operators_permission(
    rdma: dict[str, Any], allowed: dict[str, bool], named: str
) -> None:
    spec = parse_resource(with_rdma(example(), rdma)).spec
    refused = OperatorSettings(**allowed).refused_options(spec)  # type: ignore[arg-type]
    assert len(refused) == 1 and named in refused[0], refused
    both = OperatorSettings(allow_privileged_engines=True, allow_host_network=True)
    assert both.refused_options(spec) == []


async def test_a_forbidden_option_marks_the_resource_invalid_and_applies_nothing() -> None:
    resource = with_rdma(example(), {"hostDevices": True})
    resource["metadata"] = {"name": "demo", "namespace": "ns", "uid": "u-1", "generation": 1}
    requests: list[tuple[str, str]] = []
    status_patches: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        requests.append((request.method, request.url.path))
        if request.url.path.endswith("/status"):
            status_patches.append(json.loads(request.content))
        return httpx.Response(200, json=resource)

    runtime = runtime_answering(answer)
    try:
        outcome = await reconcile(runtime, "ns", "demo")
    finally:
        await runtime.close()
    assert outcome.result is ReconcileResult.INVALID
    assert "--allow-privileged-engines" in outcome.message
    assert status_patches[-1]["status"]["phase"] == "Invalid"
    written = [(method, path) for method, path in requests if method != "GET"]
    assert all(path.endswith("/status") or path.endswith("/events") for _, path in written), written
