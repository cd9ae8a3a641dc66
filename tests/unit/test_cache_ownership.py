"""The operator's watch cache under objects a tenant can create with ordinary `edit` rights: labelled
`app.kubernetes.io/managed-by=mooncake-operator` (which the watches select by) but not the operator's.
They are not kept, so they cannot grow the shared operator's memory; a pod keeps only the labels read."""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest

from mooncake_operator.api.group import API_VERSION, KIND
from mooncake_operator.build.names import (
    COMPONENT_REPLICA,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    TRAFFIC_LABEL,
)
from mooncake_operator.reconcile.act.cache import POD_LABELS_READ, Store
from mooncake_operator.reconcile.decide.observe import TEMPLATE_HASH_LABEL

pytestmark = pytest.mark.unit

MIB = 1024 * 1024
OWNER = {"apiVersion": API_VERSION, "kind": KIND, "name": "demo", "uid": "u", "controller": True}


def config_map(
    name: str, version: str, *, references: list[dict[str, Any]], size: int = 10
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "resourceVersion": version,
            "labels": {LABEL_MANAGED_BY: MANAGED_BY, LABEL_INSTANCE: "demo"},
            "ownerReferences": references,
        },
        "data": {"blob": "x" * size},
    }


def test_labelled_objects_the_operator_does_not_own_are_not_kept() -> None:
    changes: list[tuple[str, str]] = []
    store = Store(lambda namespace, owner: changes.append((namespace, owner)))
    blobs = [config_map(f"junk-{i}", str(i + 1), references=[], size=MIB) for i in range(40)]
    tracemalloc.start()
    try:
        for blob in blobs:
            assert not store.put(blob)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert store.objects == {} and changes == []
    assert held < MIB, f"the cache grew by {held / MIB:.1f} MiB for 40 MiB of objects it does not own"

    not_controller = {**OWNER, "controller": False}
    other_kind = {**OWNER, "kind": "ConfigMap"}
    for index, reference in enumerate((not_controller, other_kind)):
        assert not store.put(config_map(f"borrowed-{index}", "100", references=[reference]))
    assert store.objects == {}


def test_an_owned_child_is_kept_and_goes_when_it_loses_its_owner() -> None:
    changes: list[tuple[str, str]] = []
    store = Store(lambda namespace, owner: changes.append((namespace, owner)))
    assert store.put(config_map("demo-store-config", "1", references=[OWNER]))
    assert store.get("ns", "demo-store-config") is not None
    assert not store.put(config_map("demo-store-config", "2", references=[]))
    assert store.get("ns", "demo-store-config") is None
    assert changes == [("ns", "demo"), ("ns", "demo")]  # the owner hears of both


def test_a_pod_keeps_only_the_labels_the_operator_reads() -> None:
    assert TEMPLATE_HASH_LABEL in POD_LABELS_READ
    store = Store(lambda namespace, owner: None)
    read = {
        LABEL_INSTANCE: "demo",
        LABEL_COMPONENT: COMPONENT_REPLICA,
        TEMPLATE_HASH_LABEL: "abc",
        TRAFFIC_LABEL: "on",
    }
    noise = {f"example.com/label-{i}": "v" * 63 for i in range(2_000)}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "demo-replica-0",
            "namespace": "ns",
            "resourceVersion": "1",
            "labels": {**read, **noise},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "controller": True}],
        },
    }
    assert store.put(pod)
    kept = store.get("ns", "demo-replica-0")
    assert kept is not None and kept["metadata"]["labels"] == read
    stray = {**pod, "metadata": {**pod["metadata"], "name": "stray", "ownerReferences": []}}
    assert not store.put(stray)
