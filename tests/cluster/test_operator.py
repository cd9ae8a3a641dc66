"""The operator (kopf, KopfRunner) against a real API server: rollout, canary gate, failure, rollback,
invalid input, restart, deletion, and a resync that writes nothing.

Replica pods are created by the real StatefulSet controller and made Ready by `FakeKubelet`; the canary
talks to loopback fake vLLM replicas mapped to the resource through the operator's endpoint setting.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from tests.cluster.operator_harness import (
    FakeKubelet,
    RunningOperator,
    children,
    condition,
    events,
    eventually,
    get_serving,
    replica_pods,
    run_operator,
    serving,
    wait_for_phase,
)
from tests.support.fake_vllm import FakeCluster, Mode

from mooncake_operator.api.group import API_VERSION, KIND, RERUN_CANARY_ANNOTATION
from mooncake_operator.build.names import TRAFFIC_LABEL
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.reconcile.decide.revisions import config_map_name
from mooncake_operator.runtime.settings import OperatorSettings

RENDERED_CHILDREN = 9


def canary_posts(fakes: FakeCluster) -> int:
    return sum(len(replica.requests_to("/v1/chat/completions")) for replica in fakes.replicas)


async def rendered_children(kube: KubeClient, namespace: str) -> dict[str, dict[str, Any]] | None:
    found = await children(kube, namespace)
    rendered = {key: item for key, item in found.items() if not key.endswith(config_map_name("demo"))}
    return rendered if len(rendered) == RENDERED_CHILDREN else None


async def test_create_applies_owned_children_and_the_canary_gates_ready(
    kube: KubeClient, namespace: str, fakes: FakeCluster, operator: RunningOperator
) -> None:
    created = await kube.create(serving(namespace))
    uid = created["metadata"]["uid"]
    found = await eventually(lambda: rendered_children(kube, namespace), what="nine children")
    assert sorted(found) == [
        "ConfigMap/demo-store-config",
        "Deployment/demo-master",
        "NetworkPolicy/demo-master",
        "NetworkPolicy/demo-replica",
        "PodDisruptionBudget/demo-replica",
        "Service/demo",
        "Service/demo-master",
        "Service/demo-replicas",
        "StatefulSet/demo-replica",
    ]
    for key, child in found.items():
        owners = child["metadata"]["ownerReferences"]
        assert [(o["kind"], o["name"], o["uid"], o["controller"]) for o in owners] == [
            (KIND, "demo", uid, True)
        ], key
    # No kubelet yet: nothing is ready, nothing is proven.
    waiting = await wait_for_phase(kube, namespace, "Deploying")
    assert condition(waiting, "Ready")["status"] == "False"
    assert condition(waiting, "CanaryPassed")["reason"] == "CanaryPending"
    assert canary_posts(fakes) == 0
    assert not waiting["metadata"].get("finalizers")  # nothing to clean up: the children are owned

    async with FakeKubelet(kube, namespace):
        ready = await wait_for_phase(kube, namespace, "Ready")
    status = ready["status"]
    assert [(c["type"], c["status"]) for c in status["conditions"]] == [
        ("MasterReady", "True"),
        ("ReplicasReady", "True"),
        ("CanaryPassed", "True"),
        ("Ready", "True"),
        ("Reconciling", "False"),
        ("Stalled", "False"),
    ]
    assert status["observedGeneration"] == ready["metadata"]["generation"]
    assert status["replicas"] == {"desired": 2, "ready": 2}
    canary = status["canary"]
    assert canary["verdict"] == "Passed"
    assert [(p["writer"], p["reader"], p["verdict"]) for p in canary["pairs"]] == [
        ("demo-replica-0", "demo-replica-1", "Passed"),
        ("demo-replica-1", "demo-replica-0", "Passed"),
    ]
    # The customer's prompt on the fake tokenizer, block 32, Eagle: the reader loads every full
    # block but the last one.
    for pair in canary["pairs"]:
        assert pair["externalHitTokens"] == pair["expectedExternalHitTokens"] > 0
        assert pair["answersEqual"] is True
    assert canary["externalHitTokens"] == sum(p["externalHitTokens"] for p in canary["pairs"])
    assert status["lastGoodRevision"] == status["servingRevision"] == status["desiredRevision"]
    assert canary["target"]["revision"] == status["servingRevision"]
    assert status["outOfTraffic"] == []
    last_good = await kube.get("v1", "ConfigMap", config_map_name("demo"), namespace)
    assert last_good["metadata"]["ownerReferences"][0]["uid"] == uid

    async def transitions_posted() -> bool:  # each event follows its status write
        reasons = {event["reason"] for event in await events(kube, namespace)}
        return {"Deploying", "CanaryRunning", "Ready"} <= reasons

    await eventually(transitions_posted, what="the Deploying, CanaryRunning and Ready events")
    assert canary_posts(fakes) == 4  # one run: two pairs, a cold and a warm request each


async def ready_resource(kube: KubeClient, namespace: str, **spec_changes: Any) -> dict[str, Any]:
    await kube.create(serving(namespace, **spec_changes))
    return await wait_for_phase(kube, namespace, "Ready")


async def patch_spec(kube: KubeClient, namespace: str, spec: dict[str, Any]) -> None:
    await kube.patch_merge(API_VERSION, KIND, "demo", {"spec": spec}, namespace)


async def annotate(kube: KubeClient, namespace: str, key: str, value: str) -> None:
    patch = {"metadata": {"annotations": {key: value}}}
    await kube.patch_merge(API_VERSION, KIND, "demo", patch, namespace)


def traffic_labels(pods: list[dict[str, Any]]) -> dict[str, str | None]:
    return {pod["metadata"]["name"]: pod["metadata"]["labels"].get(TRAFFIC_LABEL) for pod in pods}


def selected_by(service: dict[str, Any], pods: list[dict[str, Any]]) -> list[str]:
    """The pods a Service routes to: those whose labels hold its whole selector."""
    selector = service["spec"]["selector"]
    return [
        pod["metadata"]["name"]
        for pod in pods
        if all(pod["metadata"]["labels"].get(key) == value for key, value in selector.items())
    ]


async def test_hold_keeps_the_corrupting_replica_out_of_the_client_service_until_a_canary_passes(
    kube: KubeClient, namespace: str, fakes: FakeCluster, operator: RunningOperator
) -> None:
    fakes[1].mode = Mode.US_EAST  # replica 1 corrupts answers computed from a loaded prefix
    async with FakeKubelet(kube, namespace):
        await kube.create(serving(namespace))
        failed = await wait_for_phase(kube, namespace, "CanaryFailed")
        status = failed["status"]
        assert condition(failed, "CanaryPassed")["reason"] == "CanaryFailed"
        ready = condition(failed, "Ready")
        assert (ready["status"], ready["reason"]) == ("False", "CanaryFailed")
        # The first differing token (by id), judged from both distributions: the fake's 'east' is
        # far from a near tie, in neither answer's top list.
        assert "corruption divergence at token 8: cold 'token_id:" in ready["message"]
        assert "not benign: the warm token is not in the cold answer's top-5" in ready["message"]
        pairs = status["canary"]["pairs"]
        assert [(p["reader"], p["verdict"]) for p in pairs] == [
            ("demo-replica-1", "Failed"),
            ("demo-replica-0", "Passed"),
        ]
        assert pairs[0]["answersEqual"] is False
        assert pairs[0]["firstMismatch"]["warm"] != pairs[0]["firstMismatch"]["cold"]
        assert any("us-east" in violation for violation in pairs[0]["violations"])
        assert status["outOfTraffic"] == ["demo-replica-1"]
        assert "lastGoodRevision" not in status

        # Nothing was proven by the failed run: neither replica serves users (both start off), and
        # the blamed one is held until a canary passes.
        pods = await replica_pods(kube, namespace)
        assert traffic_labels(pods) == {"demo-replica-0": "off", "demo-replica-1": "off"}
        assert status["traffic"]["serving"] == 0
        reasons = {entry["name"]: entry["reason"] for entry in status["traffic"]["pods"]}
        assert reasons["demo-replica-0"].startswith("not proven: canary run")
        assert reasons["demo-replica-1"].startswith("held: a failed canary blamed this replica")
        client = await kube.get("v1", "Service", "demo", namespace)
        assert selected_by(client, pods) == []
        headless = await kube.get("v1", "Service", "demo-replicas", namespace)
        assert selected_by(headless, pods) == ["demo-replica-0", "demo-replica-1"]
        warnings = [e for e in await events(kube, namespace) if e["type"] == "Warning"]
        assert [e["reason"] for e in warnings] == ["CanaryFailed"]

        # Fixed (say, by hand), then a re-run asked for: the replica is proven and gets traffic back.
        fakes[1].mode = Mode.CORRECT
        await annotate(kube, namespace, RERUN_CANARY_ANNOTATION, "after-fix")
        recovered = await wait_for_phase(kube, namespace, "Ready")
        assert recovered["status"]["outOfTraffic"] == []
        assert recovered["status"]["traffic"]["serving"] == 2
        assert recovered["status"]["canary"]["target"]["rerun"] == "after-fix"

        async def restored() -> bool:
            labels = traffic_labels(await replica_pods(kube, namespace))
            return labels == {"demo-replica-0": "on", "demo-replica-1": "on"}

        await eventually(restored, what="traffic restored")


async def test_rollback_restores_the_last_good_revision_and_proves_it_again(
    kube: KubeClient, namespace: str, fakes: FakeCluster, operator: RunningOperator
) -> None:
    buggy = "registry.invalid/vllm-mooncake:buggy"
    async with FakeKubelet(kube, namespace, fakes=fakes, modes_by_image={buggy: Mode.DOUBLE_PRUNE}):
        first = await ready_resource(kube, namespace, canary={"timeoutSeconds": 10, "onFailure": "Rollback"})
        good = first["status"]["servingRevision"]
        await patch_spec(kube, namespace, {"engine": {"image": buggy}})

        async def rolled_back() -> dict[str, Any] | None:
            body = await get_serving(kube, namespace)
            ready = condition(body, "Ready")
            return body if ready["reason"] == "RolledBack" else None

        body = await eventually(rolled_back, within=60, what="Ready reason RolledBack")
    status = body["status"]
    assert status["phase"] == "Degraded"
    assert status["servingRevision"] == status["lastGoodRevision"] == good
    assert status["failedRevision"] == status["desiredRevision"] != good
    assert condition(body, "CanaryPassed")["status"] == "True"  # the restored revision passed again
    assert status["canary"]["target"]["revision"] == good
    assert status["outOfTraffic"] == []
    # The user's spec is untouched; the children run the last good one.
    assert body["spec"]["engine"]["image"] == buggy
    replicas = await kube.get("apps/v1", "StatefulSet", "demo-replica", namespace)
    assert replicas["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":fixed")
    reasons = [e["reason"] for e in await events(kube, namespace)]
    assert "RollingBack" in reasons and "RolledBack" in reasons
    # The failed run was recorded before the rollback: three runs in all: good (2 pairs), the buggy
    # template's first two pods (2 pairs, in place with a surge pod), and the restored template over
    # all three pods (3 pairs: the kept old pod and the two replaced ones, before the surge goes).
    assert canary_posts(fakes) == 4 + 4 + 6


async def plant_image_in_last_good(kube: KubeClient, namespace: str, image: str) -> str:
    """Change the engine image in the last-good record, as someone else could; returns the genuine one."""
    stored = await kube.get("v1", "ConfigMap", config_map_name("demo"), namespace)
    genuine: str = stored["data"]["spec.json"]
    tampered = json.loads(genuine)
    tampered["engine"]["image"] = image
    patch = {"data": {"spec.json": json.dumps(tampered)}}
    await kube.patch_merge("v1", "ConfigMap", config_map_name("demo"), patch, namespace)
    return genuine


async def test_a_tampered_last_good_config_map_is_refused_not_rolled_back_to(
    kube: KubeClient, namespace: str, fakes: FakeCluster, operator: RunningOperator
) -> None:
    buggy = "registry.invalid/vllm-mooncake:buggy"
    planted = "registry.invalid/someone-elses:latest"
    async with FakeKubelet(kube, namespace, fakes=fakes, modes_by_image={buggy: Mode.DOUBLE_PRUNE}):
        first = await ready_resource(kube, namespace, canary={"timeoutSeconds": 10, "onFailure": "Rollback"})
        good = first["status"]["lastGoodRevision"]
        await patch_spec(kube, namespace, {"engine": {"image": buggy}})
        generation = (await get_serving(kube, namespace))["metadata"]["generation"]

        # Tamper only once the operator works on the new spec: while the good revision still
        # serves with a passing canary, a reconcile that finds its record changed writes it again
        # (the record no longer matches what passed), which would undo the tampering.
        async def new_spec_observed() -> bool:
            status = (await get_serving(kube, namespace)).get("status", {})
            return status.get("observedGeneration") == generation

        await eventually(new_spec_observed, within=30, what="the operator to observe the new spec")
        await plant_image_in_last_good(kube, namespace, planted)

        async def refused() -> dict[str, Any] | None:
            body = await get_serving(kube, namespace)
            return body if "Rollback refused" in condition(body, "Ready")["message"] else None

        body = await eventually(refused, within=60, what="Ready saying the rollback was refused")
    status = body["status"]
    assert status["phase"] == "CanaryFailed"
    assert condition(body, "Ready")["reason"] == "CanaryFailed"
    assert f"status.lastGoodRevision is {good}" in condition(body, "Ready")["message"]
    assert status["lastGoodRevision"] == good
    replicas = await kube.get("apps/v1", "StatefulSet", "demo-replica", namespace)
    assert replicas["spec"]["template"]["spec"]["containers"][0]["image"] == buggy  # never the planted one


async def test_a_tampered_record_of_the_revision_that_serves_is_written_again(
    kube: KubeClient, namespace: str, crd: None, fakes: FakeCluster, settings: OperatorSettings
) -> None:
    """While the revision that passed still serves, a changed record is restored from its spec."""
    with run_operator(settings):
        async with FakeKubelet(kube, namespace):
            first = await ready_resource(kube, namespace)
            genuine = await plant_image_in_last_good(kube, namespace, "registry.invalid/someone-elses:latest")

            async def restored() -> bool:
                now = await kube.get("v1", "ConfigMap", config_map_name("demo"), namespace)
                return bool(now["data"]["spec.json"] == genuine)

            await eventually(restored, within=30, what="the record written again")
            body = await get_serving(kube, namespace)
    assert body["status"]["phase"] == "Ready"
    assert body["status"]["lastGoodRevision"] == first["status"]["lastGoodRevision"]


async def test_spec_change_rolls_out_and_runs_the_canary_again(
    kube: KubeClient, namespace: str, fakes: FakeCluster, operator: RunningOperator
) -> None:
    async with FakeKubelet(kube, namespace):
        first = await ready_resource(kube, namespace)
        before = {
            pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in await replica_pods(kube, namespace)
        }
        await patch_spec(kube, namespace, {"engine": {"image": "registry.invalid/vllm-mooncake:fixed-2"}})

        async def proven_again() -> dict[str, Any] | None:
            body = await get_serving(kube, namespace)
            status = body["status"]
            fresh = status.get("phase") == "Ready" and status["observedGeneration"] == 2
            return body if fresh and status["canary"]["target"]["generation"] == 2 else None

        second = await eventually(proven_again, within=60, what="Ready at generation 2")
    assert second["status"]["servingRevision"] != first["status"]["servingRevision"]
    assert second["status"]["lastGoodRevision"] == second["status"]["servingRevision"]
    after = {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in await replica_pods(kube, namespace)}
    assert set(after) == set(before) and not set(after.values()) & set(before.values())
    # In place with a surge replica: the first two new pods are proven as a pair (2 pairs), then all
    # three after the last old pod's replacement (3 pairs); the surge pod then goes, and the two that
    # stay were proven by that run.
    target_pods = second["status"]["canary"]["target"]["replicaPods"]
    assert set(target_pods) > {f"{name}={uid}" for name, uid in after.items()}
    assert len(target_pods) == 3
    assert canary_posts(fakes) == 4 + 4 + 6
    replicas = await kube.get("apps/v1", "StatefulSet", "demo-replica", namespace)
    assert replicas["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":fixed-2")


async def test_an_invalid_resource_is_reported_and_nothing_is_applied(
    kube: KubeClient, namespace: str, operator: RunningOperator
) -> None:
    await kube.create(serving(namespace, engine={"extraArgs": ["--model=other"]}))
    invalid = await wait_for_phase(kube, namespace, "Invalid")
    ready = condition(invalid, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert ready["message"] == (
        "the spec is invalid: spec.engine: engine.extraArgs must not contain --model: "
        "it is set from model.name"
    )
    others = {condition(invalid, t)["status"] for t in ("MasterReady", "ReplicasReady", "CanaryPassed")}
    assert others == {"Unknown"}

    # Another problem: the status and a new Warning event say so.
    await patch_spec(kube, namespace, {"replicas": 1, "engine": {"extraArgs": []}})

    async def second_problem() -> list[dict[str, Any]] | None:
        warnings = await _warnings(kube, namespace)
        return warnings if len(warnings) == 2 else None

    warnings = await eventually(second_problem, what="a second Warning event")
    assert [(e["reason"], e["type"]) for e in warnings] == [("InvalidSpec", "Warning")] * 2
    assert "replicas is 1 but the canary needs at least 2 replicas" in warnings[1]["message"]
    assert await children(kube, namespace) == {}
    assert operator.runtime.kube.counts.by_verb["apply"] == 0

    # Fixed: the same resource rolls out.
    await patch_spec(kube, namespace, {"replicas": 2})
    await eventually(lambda: rendered_children(kube, namespace), what="children after the fix")


async def _warnings(kube: KubeClient, namespace: str) -> list[dict[str, Any]]:
    return [e for e in await events(kube, namespace) if e["type"] == "Warning"]


async def test_an_operator_restarted_mid_rollout_resumes_without_duplicating_anything(
    kube: KubeClient, namespace: str, crd: None, fakes: FakeCluster, settings: OperatorSettings
) -> None:
    with run_operator(settings):
        await kube.create(serving(namespace))
        await eventually(lambda: rendered_children(kube, namespace), what="children")
        await wait_for_phase(kube, namespace, "Deploying")
    # The operator is down while the pods become ready.
    async with FakeKubelet(kube, namespace):
        await eventually(lambda: _all_pods_ready(kube, namespace), what="pods ready")
        with run_operator(settings) as operator:
            ready = await wait_for_phase(kube, namespace, "Ready")
            # The rendered children were already applied; the one apply records the proven revision.
            assert operator.runtime.kube.counts.by_verb["apply"] == 1
    found = await children(kube, namespace)
    assert len(found) == RENDERED_CHILDREN + 1  # and the last-good ConfigMap
    assert len(await kube.list("v1", "Pod", namespace)) == 3  # one master, two replicas
    assert [p["metadata"]["name"] for p in await replica_pods(kube, namespace)] == [
        "demo-replica-0",
        "demo-replica-1",
    ]
    assert canary_posts(fakes) == 4  # exactly one canary run
    assert ready["status"]["canary"]["verdict"] == "Passed"


async def _all_pods_ready(kube: KubeClient, namespace: str) -> bool:
    pods = await kube.list("v1", "Pod", namespace)
    return len(pods) == 3 and all(
        any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in (p.get("status") or {}).get("conditions") or []
        )
        for p in pods
    )


async def test_a_resource_deleted_while_the_operator_is_stopped_is_gone_without_it(
    kube: KubeClient, namespace: str, crd: None, fakes: FakeCluster, settings: OperatorSettings
) -> None:
    await kube.create(serving(namespace))
    with run_operator(settings):

        async def reconciled_without_finalizer() -> dict[str, Any] | None:
            body = await get_serving(kube, namespace)
            phase = (body.get("status") or {}).get("phase")
            return body if phase and not body["metadata"].get("finalizers") else None

        await eventually(reconciled_without_finalizer, what="reconciled, with no finalizer added")
    # The operator has stopped: the API server deletes the resource on its own (kopf #942 hung here).
    await kube.delete(API_VERSION, KIND, "demo", namespace)

    async def gone() -> bool:
        return await kube.get_or_none(API_VERSION, KIND, "demo", namespace) is None

    await eventually(gone, within=10, what="the resource deleted with no operator running")


async def test_deleting_the_resource_removes_every_child(
    kube: KubeClient, namespace: str, operator: RunningOperator
) -> None:
    async with FakeKubelet(kube, namespace):
        await ready_resource(kube, namespace)
    assert len(await children(kube, namespace)) == RENDERED_CHILDREN + 1
    await kube.delete(API_VERSION, KIND, "demo", namespace)

    remaining: list[str] = []

    async def gone() -> bool:
        # Kept for the failure message: which of them outlived the resource.
        resource = await kube.get_or_none(API_VERSION, KIND, "demo", namespace)
        pods = await kube.list("v1", "Pod", namespace)
        finalizers = resource and resource["metadata"].get("finalizers")
        remaining[:] = [
            *([f"MooncakeServing/demo (finalizers {finalizers})"] if resource else []),
            *await children(kube, namespace),
            *(f"Pod/{pod['metadata']['name']}" for pod in pods),
        ]
        return not remaining

    # The garbage collector learns a new CRD's kind only at its next discovery sync (every 30 s):
    # when this test runs first, the children outlive their owner up to that long.
    try:
        await eventually(gone, within=90, what="the resource, its children and their pods to be gone")
    except AssertionError as error:
        raise AssertionError(f"{error}; still present: {remaining}") from None


async def test_a_resync_with_nothing_to_change_writes_nothing_even_across_a_restart(
    kube: KubeClient, namespace: str, crd: None, fakes: FakeCluster, settings: OperatorSettings
) -> None:
    settings = dataclasses.replace(settings, resync_seconds=1.0)
    async with FakeKubelet(kube, namespace):
        with run_operator(settings) as operator:
            await ready_resource(kube, namespace)
            # The traffic labels follow the status write: wait for them before counting.
            await eventually(lambda: _all_serving(kube, namespace), what="both replicas in traffic")
            counts = operator.runtime.kube.counts.snapshot()
            reconciles = _reconciles(operator)
            await eventually(lambda: _more_reconciles(operator, reconciles + 3), what="three resyncs")
            idle = operator.runtime.kube.counts.since(counts)
            # Every input comes from the watch cache: a resync with nothing to change makes no request.
            assert idle.writes == 0, idle.by_verb
            assert idle.reads == 0, idle.by_verb
        with run_operator(settings) as restarted:
            await eventually(lambda: _more_reconciles(restarted, 3), what="resume and two resyncs")
            assert restarted.runtime.kube.counts.writes == 0, restarted.runtime.kube.counts.by_verb
    assert canary_posts(fakes) == 4


def _reconciles(operator: Any) -> float:
    registry = operator.runtime.metrics.registry
    return sum(
        sample.value
        for metric in registry.collect()
        for sample in metric.samples
        if sample.name == "mooncake_operator_reconciles_total"
    )


async def _more_reconciles(operator: Any, at_least: float) -> bool:
    return _reconciles(operator) >= at_least


async def _all_serving(kube: KubeClient, namespace: str) -> bool:
    labels = traffic_labels(await replica_pods(kube, namespace))
    return labels == {"demo-replica-0": "on", "demo-replica-1": "on"}
