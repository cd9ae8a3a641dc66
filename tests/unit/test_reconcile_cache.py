"""The watch cache without a cluster: monotonic stores indexed by owner, projections, relists, and the
list-then-watch loop against a scripted API server; the worker's timers."""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from typing import Any

import httpx
import pytest

from mooncake_operator.api.group import API_VERSION, KIND
from mooncake_operator.api.resource import parse_resource
from mooncake_operator.build.manifests import render_all
from mooncake_operator.build.names import COMPONENT_REPLICA, LABEL_COMPONENT, LABEL_INSTANCE
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.kube.config import KubeConfig
from mooncake_operator.reconcile.act.cache import Store, WatchCache, WatchedKind, project

pytestmark = pytest.mark.unit


def pod(name: str, version: str, *, owner: str = "demo", ready: bool = False) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "resourceVersion": version,
            "labels": {LABEL_INSTANCE: owner, LABEL_COMPONENT: COMPONENT_REPLICA},
            "managedFields": [{"manager": "kubelet"}],
            "ownerReferences": [{"kind": "StatefulSet"}],
        },
        "spec": {"containers": [{"name": "vllm", "image": "x"}]},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False", "reason": "r"}],
            "containerStatuses": [{"name": "vllm", "restartCount": 2, "image": "x"}],
        },
    }


def recording_store() -> tuple[Store, list[tuple[str, str]]]:
    changes: list[tuple[str, str]] = []
    return Store(lambda namespace, owner: changes.append((namespace, owner))), changes


def test_a_store_keeps_the_newest_version_and_reports_each_change_to_the_owner() -> None:
    store, changes = recording_store()
    assert store.put(pod("demo-replica-0", "10"))
    assert not store.put(pod("demo-replica-0", "10"))  # the echo of what was stored: no change
    assert not store.put(pod("demo-replica-0", "9", ready=True))  # older: ignored
    assert store.put(pod("demo-replica-0", "11", ready=True))
    assert changes == [("ns", "demo"), ("ns", "demo")]
    assert [p["metadata"]["resourceVersion"] for p in store.owned("ns", "demo")] == ["11"]
    assert store.owned("ns", "other") == []


def test_a_delete_older_than_the_stored_object_is_ignored() -> None:
    store, changes = recording_store()
    store.put(pod("demo-replica-0", "12"))
    store.delete(pod("demo-replica-0", "11"))  # a stale delete: a newer object of that name exists
    assert store.get("ns", "demo-replica-0") is not None
    store.delete(pod("demo-replica-0", "13"))
    assert store.get("ns", "demo-replica-0") is None and store.owned("ns", "demo") == []
    assert changes == [("ns", "demo"), ("ns", "demo")]


def test_a_relist_drops_what_it_lacks_but_keeps_what_was_stored_after_it() -> None:
    store, changes = recording_store()
    store.put(pod("demo-replica-0", "5"))
    store.put(pod("demo-replica-1", "6", owner="other"))
    store.put(pod("demo-replica-2", "30"))  # e.g. a write's answer, newer than the list below
    store.replace([pod("demo-replica-0", "5")], None, "20")
    assert store.get("ns", "demo-replica-1") is None
    assert store.get("ns", "demo-replica-2") is not None
    assert ("ns", "other") in changes


def test_pods_are_kept_as_what_readiness_reads_and_other_objects_without_managed_fields() -> None:
    kept = project(pod("demo-replica-0", "3", ready=True))
    assert kept["metadata"] == {
        "name": "demo-replica-0",
        "namespace": "ns",
        "uid": "uid-demo-replica-0",
        "resourceVersion": "3",
        "labels": {LABEL_INSTANCE: "demo", LABEL_COMPONENT: COMPONENT_REPLICA},
    }
    assert kept["status"] == {
        "conditions": [{"type": "Ready", "status": "True"}],
        "containerStatuses": [{"name": "vllm", "restartCount": 2}],
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "managedFields": []}}
    assert project(service) == {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}}


def test_a_read_returns_a_copy_the_caller_may_change() -> None:
    store, _ = recording_store()
    store.put(pod("demo-replica-0", "3", ready=True))
    read = store.get("ns", "demo-replica-0")
    assert read is not None
    read["metadata"]["labels"].clear()
    store.owned("ns", "demo")[0]["status"]["conditions"].clear()
    again = store.get("ns", "demo-replica-0")
    assert again is not None and again["metadata"]["labels"][LABEL_INSTANCE] == "demo"
    assert again["status"]["conditions"] == [{"type": "Ready", "status": "True"}]


def rendered_children(count: int) -> list[dict[str, Any]]:
    """Every child of `count` resources, as a watch would deliver them (parsed JSON)."""
    objects = []
    for index in range(count):
        resource = parse_resource(
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "metadata": {"name": f"mcs-{index:03d}", "namespace": "ns"},
                "spec": {
                    "model": {"name": "MiniMaxAI/MiniMax-M2.5", "revision": "r1"},
                    "engine": {"image": "registry.invalid/vllm:1", "blockSize": 32},
                    "replicas": 2,
                    "store": {"globalSegmentSize": "1GB", "localBufferSize": "512MB"},
                },
            }
        )
        for child in render_all(resource, owner_uid=f"uid-{index}", policy_api_version="policy/v1"):
            child["metadata"]["resourceVersion"] = str(index + 1)
            objects.append(json.loads(json.dumps(child)))
    return objects


def test_the_store_holds_objects_in_a_fraction_of_their_parsed_size() -> None:
    """What bounds the operator's memory at 1,000 resources: once the events are dropped, the store
    keeps far less than the parsed dicts a watch delivers (each key and value its own Python object)."""
    lines = [json.dumps(obj) for obj in rendered_children(20)]
    stores: dict[str, Store] = {}
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        events = [json.loads(line) for line in lines]  # one watch event each
        parsed_size = tracemalloc.get_traced_memory()[0] - before
        for obj in events:
            assert stores.setdefault(obj["kind"], recording_store()[0]).put(obj)
        del events, obj
        kept_size = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept_size < parsed_size / 3, (kept_size, parsed_size)
    first = json.loads(lines[0])
    assert stores[first["kind"]].get("ns", first["metadata"]["name"]) == project(first)


def scripted_api(lists: dict[str, Any], watches: dict[str, list[bytes]]) -> httpx.MockTransport:
    """Lists by path; each watch of a path streams the next scripted body (then nothing)."""

    def answer(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.url.params.get("watch") == "true":
            bodies = watches.get(path) or [b""]
            return httpx.Response(200, content=bodies.pop(0) if len(bodies) > 1 else bodies[0])
        return httpx.Response(200, json=lists[path])

    return httpx.MockTransport(answer)


def lines(*events: dict[str, Any]) -> bytes:
    return b"".join(json.dumps(event).encode() + b"\n" for event in events)


async def test_the_cache_lists_then_follows_the_watch_and_relists_when_the_version_is_gone() -> None:
    pods_path = "/api/v1/namespaces/ns/pods"
    lists = {pods_path: {"items": [pod("demo-replica-0", "5")], "metadata": {"resourceVersion": "7"}}}
    watches = {
        pods_path: [
            lines(
                {"type": "MODIFIED", "object": pod("demo-replica-0", "8", ready=True)},
                {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}},
                {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}},
            ),
        ]
    }
    changes: list[tuple[str, str]] = []
    kube = KubeClient(KubeConfig(server="https://127.0.0.1:1"), transport=scripted_api(lists, watches))
    cache = WatchCache(
        kube,
        namespaces=("ns",),
        on_change=lambda namespace, owner: changes.append((namespace, owner)),
        kinds=(WatchedKind("v1", "Pod", "app.kubernetes.io/managed-by=mooncake-operator"),),
    )
    cache.start()
    try:
        await asyncio.wait_for(cache.wait_synced(), 5)
        for _ in range(100):
            if kube.counts.by_verb["list"] >= 2:
                break
            await asyncio.sleep(0.05)
    finally:
        await cache.close()
        await kube.aclose()
    stored = cache.get("v1", "Pod", "ns", "demo-replica-0")
    assert stored is not None and stored["status"]["conditions"] == [{"type": "Ready", "status": "True"}]
    assert kube.counts.by_verb["list"] >= 2  # the 410 made it list again
    assert kube.counts.by_verb["watch"] >= 1
    assert changes[:2] == [("ns", "demo"), ("ns", "demo")]


async def test_the_cache_absorbs_the_answers_of_writes() -> None:
    lists = {"/api/v1/namespaces/ns/pods": {"items": [], "metadata": {"resourceVersion": "1"}}}
    kube = KubeClient(KubeConfig(server="https://127.0.0.1:1"), transport=scripted_api(lists, {}))
    cache = WatchCache(
        kube, namespaces=("ns",), on_change=lambda *_: None, kinds=(WatchedKind("v1", "Pod", None),)
    )
    cache.remember(pod("demo-replica-0", "4"))
    cache.remember({"apiVersion": "v1", "kind": "Event", "metadata": {"name": "e", "namespace": "ns"}})
    assert cache.get("v1", "Pod", "ns", "demo-replica-0") is not None
    cache.forget("v1", "Pod", "ns", "demo-replica-0")
    assert cache.get("v1", "Pod", "ns", "demo-replica-0") is None
    await kube.aclose()
