"""Issue 21, Medium 8: within a namespace, a pod or StatefulSet that only carries the operator's labels
borrows nothing: the replica Services select with the label the operator's watch selects by, a retired
replica set is deleted only when it carries this resource's controller reference (UID checked), the
canary reaches each replica at the IP of the pod this resource's StatefulSet created (never by a DNS name
another pod with the same hostname/subdomain shares), and a pod the client Service selects that the
resource did not create is reported (status.foreignPods, a ForeignPodInService event), within bounds."""

from __future__ import annotations

import json
import tracemalloc
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from tests.support.fake_api import runtime_answering

from mooncake_operator.api.examples import reference_deployment
from mooncake_operator.api.resource import MooncakeServing, parse_resource
from mooncake_operator.api.status import MooncakeServingStatus
from mooncake_operator.build.names import (
    COMPONENT_REPLICA,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    TRAFFIC_LABEL,
    TRAFFIC_ON,
)
from mooncake_operator.build.replicas import replica_stateful_set
from mooncake_operator.build.services import client_service, headless_service
from mooncake_operator.reconcile.act.cache import MAX_FOREIGN_NAMES, Store
from mooncake_operator.reconcile.act.children import remove_replica_sets
from mooncake_operator.reconcile.act.core import _Actor, _Pass
from mooncake_operator.reconcile.act.snapshot import observe
from mooncake_operator.reconcile.decide import actions, choose, plan
from mooncake_operator.reconcile.decide.observe import MasterState, Observation, ReplicaState, pod_info

pytestmark = pytest.mark.unit

OWNER_UID = "u-owner"


def selects(selector: dict[str, str], pod_labels: dict[str, str]) -> bool:
    return all(pod_labels.get(key) == value for key, value in selector.items())


def test_a_pod_with_only_the_traffic_labels_is_not_selected() -> None:
    resource = reference_deployment()
    template = replica_stateful_set(resource, owner_uid=OWNER_UID)["spec"]["template"]
    ours = {**template["metadata"]["labels"], TRAFFIC_LABEL: TRAFFIC_ON}
    foreign = {
        LABEL_INSTANCE: resource.metadata.name,
        LABEL_COMPONENT: COMPONENT_REPLICA,
        TRAFFIC_LABEL: TRAFFIC_ON,
    }
    for service in (
        client_service(resource, owner_uid=OWNER_UID),
        headless_service(resource, owner_uid=OWNER_UID),
    ):
        assert selects(service["spec"]["selector"], ours)
        assert not selects(service["spec"]["selector"], foreign), service["metadata"]["name"]


def replica_set(name: str, owner_uid: str) -> dict[str, Any]:
    resource = reference_deployment()
    manifest = replica_stateful_set(resource, owner_uid=owner_uid)
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


RESOURCE_UID = "uid-demo"
OURS_UID = "sts-ours"


def demo() -> MooncakeServing:
    wire = reference_deployment().to_wire()
    wire["metadata"] = {"name": "demo", "namespace": "ns", "uid": RESOURCE_UID, "generation": 1}
    return parse_resource(wire)


def controller(kind: str, name: str, uid: str) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": kind, "name": name, "uid": uid, "controller": True}


def replica_pod(
    name: str, *, owner: dict[str, Any] | None, ip: str | None, traffic: str = "on", **spec: Any
) -> dict[str, Any]:
    resource = demo()
    labels = {
        **replica_stateful_set(resource, owner_uid=RESOURCE_UID)["spec"]["template"]["metadata"]["labels"],
        TRAFFIC_LABEL: traffic,
        "controller-revision-hash": "demo-replica-abc",
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "resourceVersion": "7",
            "labels": labels,
            "ownerReferences": [owner] if owner else [],
        },
        "spec": spec,
        "status": {"conditions": [{"type": "Ready", "status": "True"}], **({"podIP": ip} if ip else {})},
    }


def ours_set() -> dict[str, Any]:
    manifest = replica_stateful_set(demo(), owner_uid=RESOURCE_UID)
    manifest["metadata"].update(uid=OURS_UID, generation=1, resourceVersion="5")
    manifest["status"] = {"observedGeneration": 1, "updateRevision": "demo-replica-abc"}
    return manifest


async def test_the_canary_reaches_each_replica_at_the_ip_of_the_pod_this_resource_created() -> None:
    """A foreign pod with replica 0's hostname and subdomain shares its DNS record; one created by
    another StatefulSet (same labels) is kept by the cache. Neither is a replica, neither is dialled:
    the canary's URLs are the IPs of the pods whose controller is this resource's StatefulSet."""
    resource = demo()
    ours = controller("StatefulSet", "demo-replica", OURS_UID)
    impostors = [
        replica_pod(
            "demo-impostor", owner=None, ip="10.9.9.9", hostname="demo-replica-0", subdomain="demo-replicas"
        ),
        replica_pod(
            "other-replica-0", owner=controller("StatefulSet", "other-replica", "sts-x"), ip="10.9.9.8"
        ),
    ]
    runtime = runtime_answering(lambda request: httpx.Response(404, json={}))
    try:
        runtime.cache.remember(ours_set())
        for obj in [
            replica_pod("demo-replica-0", owner=ours, ip="10.1.0.10"),
            replica_pod("demo-replica-1", owner=ours, ip="fd00::11"),
            *impostors,
        ]:
            runtime.cache.remember(obj)
        seen = observe(runtime.cache, resource, "demo-replica")
        actor = _Actor(runtime, resource.to_wire())
        actor.resource = resource
        urls = _Pass(runtime, actor, MooncakeServingStatus(), runtime.clock()).replica_urls(
            resource, "demo-replica", ["demo-replica-0", "demo-replica-1"], seen
        )
    finally:
        await runtime.close()
    port = resource.spec.engine.port
    assert urls == [f"http://10.1.0.10:{port}", f"http://[fd00::11]:{port}"]
    assert [pod.name for pod in seen.replicas.pods] == ["demo-replica-0", "demo-replica-1"]
    assert seen.replicas.all_ready and seen.others == ()
    assert seen.foreign == ("demo-impostor", "other-replica-0")


def test_a_replica_without_a_pod_ip_is_not_dialled_and_the_run_says_why() -> None:
    ours = controller("StatefulSet", "demo-replica", OURS_UID)
    store = Store(lambda namespace, owner: None)
    for name, ip in (("demo-replica-0", "10.1.0.10"), ("demo-replica-1", None)):
        store.put(replica_pod(name, owner=ours, ip=ip))
    pods = tuple(pod_info(pod) for pod in store.owned("ns", "demo"))
    seen = Observation(MasterState(True, "ok"), ReplicaState(2, 2, True, "2/2", pods))
    why = plan.canary_urls(seen, ["demo-replica-0", "demo-replica-1"], 8000)
    assert isinstance(why, str) and "no pod IP yet for replica pod(s) demo-replica-1" in why
    # Two pods at one address (on the node's network, one node) are not two replicas to compare.
    store.put(
        {
            **replica_pod("demo-replica-1", owner=ours, ip="10.1.0.10"),
            "metadata": {
                **replica_pod("demo-replica-1", owner=ours, ip="10.1.0.10")["metadata"],
                "resourceVersion": "8",
            },
        }
    )
    pods = tuple(pod_info(pod) for pod in store.owned("ns", "demo"))
    seen = Observation(MasterState(True, "ok"), ReplicaState(2, 2, True, "2/2", pods))
    why = plan.canary_urls(seen, ["demo-replica-0", "demo-replica-1"], 8000)
    assert isinstance(why, str) and "share an address (http://10.1.0.10:8000)" in why


def test_foreign_pods_in_the_client_service_are_remembered_by_name_within_a_bound() -> None:
    """Pods no workload controller created are not kept (issue 21, item 6); those the client Service
    selects are remembered by name, at most MAX_FOREIGN_NAMES per resource, and forgotten when they go,
    lose a label or a relist lacks them. The owner hears of each change (its reconcile reports them)."""
    changes: list[tuple[str, str]] = []
    store = Store(lambda namespace, owner: changes.append((namespace, owner)))
    padding = "x" * 200
    many = [replica_pod(f"foreign-{i}-{padding}", owner=None, ip=None) for i in range(500)]
    tracemalloc.start()
    try:
        for pod in many:
            assert not store.put(pod)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert store.objects == {}
    names = store.foreign_names("ns", "demo")
    assert len(names) == MAX_FOREIGN_NAMES and set(names) <= {p["metadata"]["name"] for p in many}
    assert held < 64 * 1024, f"{held} bytes held for {MAX_FOREIGN_NAMES} names"
    assert changes == [("ns", "demo")] * MAX_FOREIGN_NAMES

    # Out of traffic (label off), or gone: forgotten; room for another.
    first, second = names[0], names[1]
    store.put(
        {
            **replica_pod(first, owner=None, ip=None, traffic="off"),
            "metadata": {
                **replica_pod(first, owner=None, ip=None, traffic="off")["metadata"],
                "resourceVersion": "8",
            },
        }
    )
    store.delete(replica_pod(second, owner=None, ip=None))
    assert first not in store.foreign_names("ns", "demo") and second not in store.foreign_names("ns", "demo")
    store.put(replica_pod("late", owner=None, ip=None))
    assert "late" in store.foreign_names("ns", "demo")
    # Not selected by the client Service (no traffic label), or another resource's: not this one's.
    unlabelled = replica_pod("unlabelled", owner=None, ip=None)
    del unlabelled["metadata"]["labels"][TRAFFIC_LABEL]
    assert not store.put(unlabelled) and "unlabelled" not in store.foreign_names("ns", "demo")
    # A relist that lacks them forgets them.
    store.replace([replica_pod("late", owner=None, ip=None)], "ns", "100")
    assert store.foreign_names("ns", "demo") == ["late"]


def planned(foreign: tuple[str, ...], stored: MooncakeServingStatus) -> actions.Decision:
    resource = demo()
    rendering = choose.rendering(resource, stored, None, ())
    seen = Observation(
        MasterState(False, "master pod not created yet"), ReplicaState(2, 0, False, "0/2"), foreign=foreign
    )
    timing = plan.Timing(retry_delay_seconds=10, inconclusive_retry_seconds=60, leader_check_seconds=30)
    now = datetime(2026, 12, 1, tzinfo=UTC)
    return plan.decide(plan.Snapshot(resource, stored, rendering, seen, now, timing))


def test_a_foreign_pod_in_the_client_service_is_a_warning_event_and_a_status_field() -> None:
    decision = planned(("impostor",), MooncakeServingStatus())
    assert decision.status.foreign_pods == ["impostor"]
    [event] = [a for a in decision.actions if isinstance(a, actions.PostEvent) and a.type == "Warning"]
    assert event.reason == "ForeignPodInService" and "impostor" in event.message
    # Once reported, the next passes say it in the status only; a new one is an event again.
    again = planned(("impostor",), decision.status)
    assert again.status.foreign_pods == ["impostor"]
    assert not [
        a for a in again.actions if isinstance(a, actions.PostEvent) and a.reason == "ForeignPodInService"
    ]
    more = planned(("impostor", "second"), decision.status)
    assert [a.reason for a in more.actions if isinstance(a, actions.PostEvent)].count(
        "ForeignPodInService"
    ) == 1
    # Gone: the field goes too (unset, not an empty list).
    assert planned((), decision.status).status.foreign_pods is None
