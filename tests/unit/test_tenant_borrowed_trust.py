"""Issue 21, Medium 8: within a namespace, a pod or StatefulSet that only carries the operator's labels
borrows nothing: the replica Services select with the label the operator's watch selects by, and a
retired replica set is deleted only when it carries this resource's controller reference (UID checked)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from tests.support.fake_api import runtime_answering

from mooncake_operator import render
from mooncake_operator.examples import customer_deployment
from mooncake_operator.reconcile.children import remove_replica_sets

pytestmark = pytest.mark.unit

OWNER_UID = "u-owner"


def selects(selector: dict[str, str], pod_labels: dict[str, str]) -> bool:
    return all(pod_labels.get(key) == value for key, value in selector.items())


def test_a_pod_with_only_the_traffic_labels_is_not_selected() -> None:
    resource = customer_deployment()
    template = render.replica_stateful_set(resource, owner_uid=OWNER_UID)["spec"]["template"]
    ours = {**template["metadata"]["labels"], render.TRAFFIC_LABEL: render.TRAFFIC_ON}
    foreign = {
        render.LABEL_INSTANCE: resource.metadata.name,
        render.LABEL_COMPONENT: render.COMPONENT_REPLICA,
        render.TRAFFIC_LABEL: render.TRAFFIC_ON,
    }
    for service in (
        render.client_service(resource, owner_uid=OWNER_UID),
        render.headless_service(resource, owner_uid=OWNER_UID),
    ):
        assert selects(service["spec"]["selector"], ours)
        assert not selects(service["spec"]["selector"], foreign), service["metadata"]["name"]


def replica_set(name: str, owner_uid: str) -> dict[str, Any]:
    resource = customer_deployment()
    manifest = render.replica_stateful_set(resource, owner_uid=owner_uid)
    manifest["metadata"].update(name=name, namespace="ns", uid=f"sts-{name}", resourceVersion="5")
    return manifest


async def test_a_retired_set_is_deleted_only_with_this_resources_controller_reference() -> None:
    deletes: list[tuple[str, dict[str, Any]]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            deletes.append((request.url.path.rsplit("/", 1)[-1], json.loads(request.content)))
        return httpx.Response(200, json={})

    runtime = runtime_answering(answer)
    kube = runtime.kube
    try:
        # Same labels, another resource's controller reference (e.g. one of the same name, re-created).
        runtime.cache.remember(replica_set("demo-rforeign", "u-another"))
        runtime.cache.remember(replica_set("demo-rours", OWNER_UID))
        await remove_replica_sets(kube, runtime.cache, "ns", ["demo-rforeign", "demo-rours"], OWNER_UID)
    finally:
        await runtime.close()
    assert [name for name, _ in deletes] == ["demo-rours"]
    assert deletes[0][1]["preconditions"] == {"uid": "sts-demo-rours"}
