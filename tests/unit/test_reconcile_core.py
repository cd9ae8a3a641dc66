"""The reconcile's edges without a cluster: a resource that is gone, an API server that fails, the order
of the status write and the traffic labels."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from tests.support import fake_api
from tests.support.fake_api import InMemoryApi

from mooncake_operator.api.examples import reference_deployment
from mooncake_operator.api.group import API_VERSION, KIND
from mooncake_operator.api.resource import MooncakeServing, parse_resource
from mooncake_operator.api.status import MooncakeServingStatus
from mooncake_operator.build import replicas as replica_builders
from mooncake_operator.build.manifests import render_all
from mooncake_operator.build.names import (
    COMPONENT_MASTER,
    COMPONENT_REPLICA,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    TRAFFIC_LABEL,
    replica_set_name,
    selector,
)
from mooncake_operator.build.replicas import replica_pod_template, replica_template_id
from mooncake_operator.reconcile.act.children import with_applied_hash
from mooncake_operator.reconcile.act.core import Runtime, reconcile
from mooncake_operator.reconcile.decide.actions import ReconcileResult
from mooncake_operator.reconcile.decide.observe import (
    TEMPLATE_HASH_LABEL,
    MasterState,
    Observation,
    ReplicaState,
)

pytestmark = pytest.mark.unit

# The single master's pod belongs to its Deployment's ReplicaSet (the cache keeps pods of workloads only).
MASTER_REPLICA_SET = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "controller": True}


def runtime_answering(
    handler: Callable[[httpx.Request], httpx.Response],
    *,
    lists: bool = False,
    replica_endpoints: dict[str, tuple[str, ...]] | None = None,
) -> Runtime:
    """`fake_api.runtime_answering` retrying after 3 s."""
    return fake_api.runtime_answering(
        handler, lists=lists, retry_delay_seconds=3, replica_endpoints=replica_endpoints or {}
    )


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


def held_world() -> tuple[InMemoryApi, MooncakeServing]:
    """A resource whose failed canary held replica 1 out of traffic; then its canary was turned off, which
    would put replica 1 back in traffic."""
    spec = {
        "model": {"name": "tiny"},
        "engine": {"image": "registry.invalid/vllm:1", "blockSize": 32},
        "replicas": 2,
        "store": {"globalSegmentSize": "1GB", "localBufferSize": "512MB"},
        "canary": {"enabled": False},
    }
    meta = {"name": "demo", "namespace": "ns", "uid": "uid-demo", "generation": 3}
    resource = parse_resource({"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "spec": spec})
    world = InMemoryApi()
    pods = [
        {"name": "demo-replica-0", "uid": "p0", "serving": True, "reason": "proven", "provenBy": "r1"},
        {"name": "demo-replica-1", "uid": "p1", "serving": False, "reason": "held", "provenBy": None},
    ]
    status = {
        "phase": "CanaryFailed",
        "outOfTraffic": ["demo-replica-1"],
        "traffic": {"serving": 1, "pods": pods},
    }
    body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "spec": spec, "status": status}
    world.put("/apis/serving.mooncake-operator.dev/v1alpha1/namespaces/ns/mooncakeservings/demo", body)
    put_children(world, resource)
    ready = {"conditions": [{"type": "Ready", "status": "True"}]}
    managed = {LABEL_MANAGED_BY: MANAGED_BY}
    master_labels = {**selector(resource, COMPONENT_MASTER), **managed}
    world.put(
        "/api/v1/namespaces/ns/pods/demo-master-x",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "demo-master-x",
                "namespace": "ns",
                "uid": "m",
                "labels": master_labels,
                "ownerReferences": [MASTER_REPLICA_SET],
            },
            "status": ready,
        },
    )
    for ordinal, traffic in ((0, "on"), (1, "off")):
        put_replica_pod(world, resource, f"demo-replica-{ordinal}", f"p{ordinal}", traffic)
    return world, resource


def put_children(world: InMemoryApi, resource: MooncakeServing, replica_set: str | None = None) -> None:
    """The rendered children, rolled out (the StatefulSet at revision hash-a)."""
    for manifest in render_all(resource, owner_uid="uid-demo", replica_set=replica_set):
        child = with_applied_hash(manifest)
        child["metadata"]["generation"] = 1
        kind = child["kind"]
        if kind == "StatefulSet":
            child["metadata"]["uid"] = f"uid-{child['metadata']['name']}"
            child["status"] = {"observedGeneration": 1, "updateRevision": "hash-a"}
        if kind == "Deployment":
            child["status"] = {"observedGeneration": 1, "updatedReplicas": 1}
        group = "/apis/apps/v1" if kind in ("StatefulSet", "Deployment") else "/api/v1"
        plural = {"StatefulSet": "statefulsets", "Deployment": "deployments"}.get(kind, kind.lower() + "s")
        world.put(f"{group}/namespaces/ns/{plural}/{child['metadata']['name']}", child)


def put_replica_pod(world: InMemoryApi, resource: MooncakeServing, name: str, uid: str, traffic: str) -> None:
    """A pod the replica set SET (NAME = SET-<ordinal>) created: its controller reference names the set's
    UID (as put_children gives it)."""
    replica_set, ordinal = name.rsplit("-", 1)
    labels = {
        **selector(resource, COMPONENT_REPLICA),
        LABEL_MANAGED_BY: MANAGED_BY,
        TEMPLATE_HASH_LABEL: "hash-a",
        TRAFFIC_LABEL: traffic,
    }
    world.put(
        f"/api/v1/namespaces/ns/pods/{name}",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": "ns",
                "uid": uid,
                "labels": labels,
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "StatefulSet",
                        "name": replica_set,
                        "uid": f"uid-{replica_set}",
                        "controller": True,
                    }
                ],
            },
            "status": {
                "conditions": [{"type": "Ready", "status": "True"}],
                "podIP": f"192.0.2.{int(ordinal) + 1}",
            },
        },
    )


def blue_green_world() -> tuple[InMemoryApi, str]:
    """BlueGreen without a canary: demo-replica (image 1) serves; the spec moved to image 2, whose
    candidate set is up with both replicas Ready. Returns the world and the candidate's name."""

    def spec(image: str) -> dict[str, Any]:
        return {
            "model": {"name": "tiny"},
            "engine": {"image": image, "blockSize": 32},
            "replicas": 2,
            "store": {"globalSegmentSize": "1GB", "localBufferSize": "512MB"},
            "canary": {"enabled": False},
            "rollout": {"strategy": "BlueGreen"},
        }

    meta = {"name": "demo", "namespace": "ns", "uid": "uid-demo", "generation": 3}

    def parsed(image: str) -> MooncakeServing:
        body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "spec": spec(image)}
        return parse_resource(body)

    old, new = parsed("registry.invalid/vllm:1"), parsed("registry.invalid/vllm:2")
    candidate = replica_set_name(new, replica_template_id(new))
    world = InMemoryApi()
    pods = [
        {"name": f"demo-replica-{i}", "uid": f"b{i}", "serving": True, "reason": "proven", "provenBy": "r1"}
        for i in (0, 1)
    ]
    status = {
        "phase": "Ready",
        "traffic": {"serving": 2, "pods": pods},
        "rollout": {"strategy": "BlueGreen", "servingSet": "demo-replica"},
    }
    body = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": meta,
        "spec": spec("registry.invalid/vllm:2"),
        "status": status,
    }
    world.put("/apis/serving.mooncake-operator.dev/v1alpha1/namespaces/ns/mooncakeservings/demo", body)
    put_children(world, old)
    put_children(world, new, candidate)
    world.put(
        "/api/v1/namespaces/ns/pods/demo-master-x",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "demo-master-x",
                "namespace": "ns",
                "uid": "m",
                "labels": {
                    **selector(new, COMPONENT_MASTER),
                    LABEL_MANAGED_BY: MANAGED_BY,
                },
                "ownerReferences": [MASTER_REPLICA_SET],
            },
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        },
    )
    for i in (0, 1):
        put_replica_pod(world, old, f"demo-replica-{i}", f"b{i}", "on")
        put_replica_pod(world, new, f"{candidate}-{i}", f"g{i}", "off")
    return world, candidate


def runtime_of(world: InMemoryApi) -> Runtime:
    return runtime_answering(world.handle, lists=True)


async def test_a_failed_status_write_never_puts_a_held_replica_back_in_traffic(
    closing: list[Runtime],
) -> None:
    world, _ = held_world()
    world.fail_status = True
    runtime = runtime_of(world)
    closing.append(runtime)
    outcome = await reconcile(runtime, "ns", "demo")
    assert outcome.result is ReconcileResult.ERROR and "etcd timeout" in outcome.message
    assert not [path for method, path in world.requests if method == "PATCH" and "/pods/" in path]
    label = world.objects["/api/v1/namespaces/ns/pods/demo-replica-1"]["metadata"]["labels"]
    assert label[TRAFFIC_LABEL] == "off"

    # Once the status is written, the label follows it.
    world.fail_status = False
    outcome = await reconcile(runtime, "ns", "demo")
    assert outcome.result is ReconcileResult.READY
    patches = [path for method, path in world.requests if method == "PATCH"]
    assert patches[-2:] == [
        "/apis/serving.mooncake-operator.dev/v1alpha1/namespaces/ns/mooncakeservings/demo/status",
        "/api/v1/namespaces/ns/pods/demo-replica-1",
    ]
    assert label[TRAFFIC_LABEL] == "on"


def _demo_resource() -> dict[str, Any]:
    resource = reference_deployment().to_wire()
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


async def test_a_blue_green_switch_writes_the_status_then_the_labels_then_deletes_the_old_set(
    closing: list[Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    world, candidate = blue_green_world()
    runtime = runtime_of(world)
    closing.append(runtime)
    rendered = replica_pod_template
    templates: list[str] = []

    def counted(resource: MooncakeServing, set_selector: dict[str, str]) -> dict[str, Any]:
        templates.append(resource.metadata.name)
        return rendered(resource, set_selector)

    monkeypatch.setattr(replica_builders, "replica_pod_template", counted)
    outcome = await reconcile(runtime, "ns", "demo")
    assert outcome.result is ReconcileResult.READY, outcome.message
    assert templates == ["demo"]  # the pass rendered the replica pod template once (sets, digest, child)
    writes = [(method, path) for method, path in world.requests if method in ("PATCH", "DELETE")]
    status_path = "/apis/serving.mooncake-operator.dev/v1alpha1/namespaces/ns/mooncakeservings/demo/status"
    # Pods going in first, so the client Service is never empty; the old set goes last.
    assert writes[-6:] == [
        ("PATCH", status_path),
        ("PATCH", f"/api/v1/namespaces/ns/pods/{candidate}-0"),
        ("PATCH", f"/api/v1/namespaces/ns/pods/{candidate}-1"),
        ("PATCH", "/api/v1/namespaces/ns/pods/demo-replica-0"),
        ("PATCH", "/api/v1/namespaces/ns/pods/demo-replica-1"),
        ("DELETE", "/apis/apps/v1/namespaces/ns/statefulsets/demo-replica"),
    ]
    # The serving set was never re-applied (it ran as it was until removed).
    assert ("PATCH", "/apis/apps/v1/namespaces/ns/statefulsets/demo-replica") not in world.requests
    for i in (0, 1):
        labels = world.objects[f"/api/v1/namespaces/ns/pods/{candidate}-{i}"]["metadata"]["labels"]
        assert labels[TRAFFIC_LABEL] == "on"
        labels = world.objects[f"/api/v1/namespaces/ns/pods/demo-replica-{i}"]["metadata"]["labels"]
        assert labels[TRAFFIC_LABEL] == "off"


async def test_a_pass_over_a_benign_divergence_posts_an_event(closing: list[Runtime]) -> None:
    """The operator's canary on fake replicas whose last answer token is a near tie tipped on the reader:
    the run passes, status.canary holds the divergence, and a CanaryBenignDivergence Event says so (an action
    of the decision after the run)."""
    from tests.support.fake_vllm import VOCAB, FakeCluster

    from mooncake_operator.reconcile.act.core import _Actor, _Pass
    from mooncake_operator.reconcile.decide.actions import Decision, RunCanary
    from mooncake_operator.reconcile.decide.schedule import current_target

    events: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path.endswith("/events"):
            events.append(json.loads(request.content))
            return httpx.Response(201, json=json.loads(request.content))
        return httpx.Response(404, json={"kind": "Status", "code": 404})

    def tie(choose: str, other: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
        chosen, runner_up = VOCAB.word(choose), VOCAB.word(other)

        def rewrite(payload: dict[str, Any]) -> dict[str, Any]:
            choice = payload["choices"][0]
            content = choice["logprobs"]["content"]
            top = [
                {"token": f"token_id:{chosen}", "logprob": -0.7},
                {"token": f"token_id:{runner_up}", "logprob": -0.75},
                *({"token": f"token_id:{900 + i}", "logprob": -5.0 - i} for i in range(3)),
            ]
            content[-1] = {**content[-1], "token": f"token_id:{chosen}", "logprob": -0.7, "top_logprobs": top}
            choice["message"]["content"] = VOCAB.decode([int(item["token"][9:]) for item in content])
            return payload

        return rewrite

    with FakeCluster.start(2, block_size=16) as cluster:
        cluster[0].payload_filter = tie(".", "!")
        cluster[1].payload_filter = tie("!", ".")
        wire = reference_deployment().to_wire()
        wire["metadata"].update(name="x", namespace="ns", uid="u1")
        wire["spec"]["canary"] = {
            "pairs": "first",
            "expectations": [],
            "suite": [],
            "request": {"messages": [{"role": "user", "content": "word " * 100}], "max_tokens": 8},
        }
        serving = MooncakeServing.model_validate(wire)
        runtime = runtime_answering(handler, replica_endpoints={"ns/x-replica": tuple(cluster.urls)})
        closing.append(runtime)
        actor = _Actor(runtime, wire)
        actor.resource = serving
        target = current_target(
            revision="r", generation=1, replica_pods=[], master_pod=None, master_restarts=0, rerun=None
        )
        run = await _Pass(runtime, actor, MooncakeServingStatus(), runtime.clock()).run_canary(
            serving,
            "x-replica",
            ["x-replica-0", "x-replica-1"],
            RunCanary(target, "no canary has run against these replicas yet"),
            Observation(MasterState(False, ""), ReplicaState(2, 0, False, "")),
        )
    assert run.canary.verdict == "Passed", run.canary.reason
    divergence = run.canary.pairs[0].divergence
    assert divergence is not None and divergence.kind == "benign"
    assert (divergence.cold_token, divergence.warm_token) == (
        f"token_id:{VOCAB.word('.')}",
        f"token_id:{VOCAB.word('!')}",
    )
    # The Event is an action of the decision after the run (plan.decide puts the run's events first),
    # not a request of the run itself.
    assert events == []
    [event] = run.events
    assert (event.reason, event.type) == ("CanaryBenignDivergence", "Normal")
    assert "passed over a benign divergence" in event.message
    await actor.carry_out(Decision(run.events, None))
    [posted] = events
    assert (posted["reason"], posted["type"]) == ("CanaryBenignDivergence", "Normal")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"pod": {"volumes": [{"name": "hf-cache", "emptyDir": {}}]}}, "pod.volumes: hf-cache"),
        ({"pod": {"sidecars": [{"name": "vllm", "image": "x:1"}]}}, "pod.sidecars/pod.initContainers: vllm"),
        ({"pod": {"automountServiceAccountToken": True}}, "pod.automountServiceAccountToken"),
        ({"engine": {"image": "e:1", "extraArgs": ["-dp", "2"]}}, "engine.extraArgs must not contain -dp"),
        ({"engine": {"image": "e:1", "tensorParallelSize": 16}}, "engine.gpusPerNode (8)"),
    ],
)
async def test_an_invalid_engine_pod_is_marked_invalid_and_nothing_is_applied(
    change: dict[str, Any], field: str, closing: list[Runtime]
) -> None:
    resource = _demo_resource()
    resource["spec"].update(change)
    writes: list[tuple[str, str]] = []
    status_patches: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method != "GET":
            writes.append((request.method, request.url.path))
        if request.url.path.endswith("/status"):
            status_patches.append(json.loads(request.content))
        return httpx.Response(200, json=resource)

    runtime = runtime_answering(handler)
    closing.append(runtime)
    outcome = await reconcile(runtime, "ns", "demo")
    assert outcome.result is ReconcileResult.INVALID
    assert field in outcome.message
    assert all(path.endswith("/status") or "/events" in path for _, path in writes), writes
    status = status_patches[-1]["status"]
    assert status["phase"] == "Invalid"
    conditions = {c["type"]: c for c in status["conditions"]}
    assert (conditions["Stalled"]["status"], conditions["Stalled"]["reason"]) == ("True", "InvalidSpec")
    assert conditions["Reconciling"]["status"] == "False"
