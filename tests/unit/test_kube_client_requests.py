"""kube/client.py's requests on the wire, against an in-process transport: one pagination loop for list and
list_snapshot, one PATCH for apply, merge patches and status patches (each counted under its verb)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from mooncake_operator.kube.client import APPLY_PATCH, MERGE_PATCH, KubeClient
from mooncake_operator.kube.config import KubeConfig

pytestmark = pytest.mark.unit

CONFIG = KubeConfig(server="https://127.0.0.1:6443", token="t")


def paged(requests: list[httpx.Request]) -> httpx.MockTransport:
    pages = {
        None: {
            "metadata": {"resourceVersion": "7", "continue": "c1"},
            "items": [{"metadata": {"name": "a"}}],
        },
        "c1": {
            "metadata": {"resourceVersion": "9", "continue": "c2"},
            "items": [{"metadata": {"name": "b"}}],
        },
        "c2": {"metadata": {"resourceVersion": "9"}, "items": [{"metadata": {"name": "c"}}]},
    }

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return httpx.Response(200, json=pages[request.url.params.get("continue")])

    return httpx.MockTransport(handler)


async def test_list_and_list_snapshot_page_through_the_same_loop() -> None:
    requests: list[httpx.Request] = []
    async with KubeClient(CONFIG, transport=paged(requests)) as kube:
        items = await kube.list("v1", "Pod", "ns", label_selector="a=b", field_selector="spec.nodeName=n")
        assert [(i["apiVersion"], i["kind"], i["metadata"]["name"]) for i in items] == [
            ("v1", "Pod", "a"),
            ("v1", "Pod", "b"),
            ("v1", "Pod", "c"),
        ]
        assert [dict(r.url.params) for r in requests] == [
            {"limit": "500", "labelSelector": "a=b", "fieldSelector": "spec.nodeName=n"},
            {"limit": "500", "labelSelector": "a=b", "fieldSelector": "spec.nodeName=n", "continue": "c1"},
            {"limit": "500", "labelSelector": "a=b", "fieldSelector": "spec.nodeName=n", "continue": "c2"},
        ]
        requests.clear()
        snapshot, version = await kube.list_snapshot("v1", "Pod", "ns")
        # One paginated list is one snapshot: the first page names its resourceVersion.
        assert ([i["metadata"]["name"] for i in snapshot], version) == (["a", "b", "c"], "7")
        assert requests[0].url.path == "/api/v1/namespaces/ns/pods"
        assert kube.counts.by_verb["list"] == 6


async def test_every_patch_is_one_request_shape() -> None:
    seen: list[tuple[str, str, dict[str, str], str | None, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(
            (
                request.method,
                request.url.path,
                dict(request.url.params),
                request.headers.get("content-type"),
                body,
            )
        )
        return httpx.Response(200, json={"kind": "ConfigMap", "metadata": {"name": "x"}})

    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": "ns"}}
    async with KubeClient(CONFIG, transport=httpx.MockTransport(handler)) as kube:
        await kube.apply(config_map, field_manager="m")
        await kube.apply(config_map, field_manager="m", force=False, dry_run=True)
        await kube.patch_merge("v1", "ConfigMap", "x", {"data": {"a": "1"}}, "ns")
        await kube.patch_status(
            "v1", "ConfigMap", "x", {"phase": "Ready"}, "ns", field_manager="m", resource_version="5"
        )
        assert (
            kube.counts.by_verb["apply"],
            kube.counts.by_verb["patch"],
            kube.counts.by_verb["patch_status"],
        ) == (
            1,
            1,
            1,
        )
        assert kube.counts.dry_runs == 1
    path = "/api/v1/namespaces/ns/configmaps/x"
    assert seen == [
        ("PATCH", path, {"fieldManager": "m", "force": "true"}, APPLY_PATCH, config_map),
        ("PATCH", path, {"fieldManager": "m", "force": "false", "dryRun": "All"}, APPLY_PATCH, config_map),
        ("PATCH", path, {}, MERGE_PATCH, {"data": {"a": "1"}}),
        (
            "PATCH",
            path + "/status",
            {"fieldManager": "m"},
            MERGE_PATCH,
            {"status": {"phase": "Ready"}, "metadata": {"resourceVersion": "5"}},
        ),
    ]
