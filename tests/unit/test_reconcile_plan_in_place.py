"""InPlace rollouts through `choose` and `plan.decide`: the StatefulSet is rendered with the planner's
replicas and partition, a retired pod's traffic label goes off in the same pass, the canary proves only
the new pods, the status says what the rollout does (or, paused, what waits), and the resource is not
Ready while old pods remain."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit import test_reconcile_plan as base
from tests.unit.test_reconcile_plan import MASTER, TIMING, labels, serving_entry

from mooncake_operator.api.group import API_VERSION, KIND
from mooncake_operator.api.resource import MooncakeServing, parse_resource
from mooncake_operator.api.status import MooncakeServingStatus, RolloutStatus, TrafficStatus
from mooncake_operator.build.digests import spec_hash
from mooncake_operator.build.manifests import render_all
from mooncake_operator.build.replicas import replica_template_id
from mooncake_operator.reconcile.decide import choose, plan
from mooncake_operator.reconcile.decide.actions import RunCanary
from mooncake_operator.reconcile.decide.conditions import READY, find
from mooncake_operator.reconcile.decide.observe import (
    LiveSet,
    MasterState,
    Observation,
    PodInfo,
    ReplicaState,
)

pytestmark = pytest.mark.unit

OLD_IMAGE = "registry.invalid/vllm-mooncake:1"
NEW_IMAGE = "registry.invalid/vllm-mooncake:2"
SET = "demo-replica"


def resource(image: str = NEW_IMAGE, **rollout: Any) -> MooncakeServing:
    spec: dict[str, Any] = {
        "model": {"name": "tiny", "revision": "r1"},
        "engine": {"image": image, "blockSize": 32},
        "replicas": 2,
        "store": {"globalSegmentSize": "1GB", "localBufferSize": "512MB"},
    }
    if rollout:
        spec["rollout"] = rollout
    return parse_resource(
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": "demo", "namespace": "ns", "generation": 3},
            "spec": spec,
        }
    )


T_OLD, T_NEW = replica_template_id(resource(OLD_IMAGE)), replica_template_id(resource())
OLD_HASH, NEW_HASH = "hash-old", "hash-new"


def pod(ordinal: int, template_hash: str, *, traffic: str = "on", uid: str | None = None) -> PodInfo:
    return PodInfo(
        f"{SET}-{ordinal}", uid or f"uid-{ordinal}-{template_hash}", True, False, template_hash, 0, traffic
    )


def status_serving(*pods: PodInfo, serving: tuple[bool, ...] | None = None) -> MooncakeServingStatus:
    flags = serving or tuple(True for _ in pods)
    entries = [
        serving_entry(p) if on else serving_entry(p).model_copy(update={"serving": False})
        for p, on in zip(pods, flags, strict=True)
    ]
    return MooncakeServingStatus(
        phase="Ready",
        traffic=TrafficStatus(serving=sum(flags), pods=entries),
        rollout=RolloutStatus(strategy="InPlace", serving_set=SET),
        last_good_revision=spec_hash(resource(OLD_IMAGE).spec),
        canary=base.run("Passed", *pods, revision=spec_hash(resource(OLD_IMAGE).spec), run_id="run-1"),
    )


def live(
    template: str, replicas: int, partition: int | None, *pods: PodInfo, revision: str = NEW_HASH
) -> LiveSet:
    return LiveSet(SET, template, replicas, partition, True, revision, pods)


def observed(active: tuple[PodInfo, ...], *, ready: bool) -> Observation:
    state = ReplicaState(2, len(active), ready, "ok", active, expected=len(active))
    return Observation(MasterState(True, "master ready", MASTER), state)


def test_a_new_template_adds_a_surge_pod_and_takes_the_highest_old_pod_out_first() -> None:
    p0, p1 = pod(0, OLD_HASH), pod(1, OLD_HASH)
    current = status_serving(p0, p1)
    rendered = choose.rendering(resource(), current, None, [live(T_OLD, 2, None, p0, p1, revision=OLD_HASH)])
    assert rendered.step is not None
    assert (rendered.step.replicas, rendered.step.partition, rendered.step.retire) == (3, 2, (f"{SET}-1",))
    manifests = render_all(
        rendered.serving,
        owner_uid="u",
        template=rendered.template,
        replicas=rendered.step.replicas,
        partition=rendered.step.partition,
    )
    stateful_set = next(m for m in manifests if m["kind"] == "StatefulSet" and m["metadata"]["name"] == SET)
    assert stateful_set["spec"]["replicas"] == 3
    assert stateful_set["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"partition": 2},
    }
    decision = plan.decide(
        plan.Snapshot(resource(), current, rendered, observed((p0, p1), ready=False), base.NOW, TIMING)
    )
    assert labels(decision) == {f"{SET}-1": "off"}
    written = decision.status
    assert (
        written.rollout is not None
        and "taking demo-replica-1 out of the client Service" in written.rollout.message
    )
    assert [entry.serving for entry in written.traffic.pods] == [True, False]  # type: ignore[union-attr]


def test_the_canary_proves_only_the_new_pods_and_the_resource_stays_deploying() -> None:
    p0 = pod(0, OLD_HASH)
    n1, n2 = pod(1, NEW_HASH, traffic="off"), pod(2, NEW_HASH, traffic="off")
    current = status_serving(p0, n1, n2, serving=(True, False, False))
    rendered = choose.rendering(resource(), current, None, [live(T_NEW, 3, 1, p0, n1, n2)])
    assert rendered.canary_pods() == [f"{SET}-1", f"{SET}-2"]
    view = rendered.rollout_view()
    assert view is not None and view.kept == (f"{SET}-0",) and view.waiting == ""
    snapshot = plan.Snapshot(
        resource(), current, rendered, observed((p0, n1, n2), ready=True), base.NOW, TIMING
    )
    first = plan.decide(snapshot)
    order = first.canary
    assert isinstance(order, RunCanary)
    assert order.target.replica_pods == [n1.identity, n2.identity]
    fresh = base.CanaryRun(
        base.run("Passed", n1, n2, revision=spec_hash(resource().spec), run_id="run-2"), ()
    )
    after = plan.decide(snapshot, fresh)
    assert labels(after) == {f"{SET}-1": "on", f"{SET}-2": "on"}
    ready = find(after.status.conditions, READY)
    assert after.status.phase == "Deploying" and ready is not None and ready.status == "False"
    assert "rolling out in place" in ready.message


def test_a_single_new_pod_waits_for_a_partner() -> None:
    p0, p1 = pod(0, OLD_HASH), pod(1, OLD_HASH)
    current = status_serving(p0, p1)
    rendered = choose.rendering(resource(), current, None, [live(T_OLD, 2, None, p0, p1, revision=OLD_HASH)])
    view = rendered.rollout_view()
    assert view is not None and rendered.canary_pods() == [f"{SET}-2"]
    assert "waits for a second" in view.waiting


def test_paused_renders_no_pod_change_and_says_what_waits() -> None:
    p0, p1 = pod(0, OLD_HASH), pod(1, OLD_HASH)
    current = status_serving(p0, p1)
    paused = resource(paused=True)
    rendered = choose.rendering(paused, current, None, [live(T_OLD, 2, None, p0, p1, revision=OLD_HASH)])
    assert rendered.step is not None and (rendered.step.replicas, rendered.step.partition) == (2, 2)
    assert rendered.canary_pods() == []
    view = rendered.rollout_view()
    assert view is not None and view.waiting.startswith("rollout paused")
    decision = plan.decide(
        plan.Snapshot(paused, current, rendered, observed((), ready=False), base.NOW, TIMING)
    )
    assert labels(decision) == {}
    assert decision.status.rollout is not None and "rollout paused" in decision.status.rollout.message
    assert decision.canary is None


def test_a_bluegreen_candidate_starts_no_pod_while_paused() -> None:
    p0, p1 = pod(0, OLD_HASH), pod(1, OLD_HASH)
    current = status_serving(p0, p1)
    paused = resource(strategy="BlueGreen", paused=True)
    rendered = choose.rendering(paused, current, None, [live(T_OLD, 2, None, p0, p1, revision=OLD_HASH)])
    assert rendered.sets.candidate is not None
    assert rendered.step is not None and rendered.step.replicas == 0 and "paused" in rendered.step.message


def test_surge_and_unavailable_too_small_to_pair_are_refused() -> None:
    with pytest.raises(Exception, match="maxSurge"):
        resource(maxSurge=0, maxUnavailable=1)
    resource(maxSurge=0, maxUnavailable=2)  # two old pods go at once and pair
