"""BlueGreen rollouts in the planner: which set the spec goes to, the switch after a pass, and aborts."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit import test_reconcile_plan as base
from tests.unit.test_reconcile_plan import MASTER, TIMING, labels, serving_entry, snapshot, summary

from mooncake_operator.api.group import API_VERSION, KIND
from mooncake_operator.api.resource import MAX_NAME_LENGTH, MooncakeServing, parse_resource
from mooncake_operator.api.status import CanaryStatus, MooncakeServingStatus, RolloutStatus, TrafficStatus
from mooncake_operator.build.digests import spec_hash
from mooncake_operator.build.names import replica_set_name
from mooncake_operator.build.replicas import replica_template_id
from mooncake_operator.reconcile.decide import choose, plan
from mooncake_operator.reconcile.decide.actions import Decision, ReconcileResult, RemoveSets
from mooncake_operator.reconcile.decide.canary_run import CanaryRun
from mooncake_operator.reconcile.decide.choose import SetChoice
from mooncake_operator.reconcile.decide.observe import (
    LiveSet,
    MasterState,
    Observation,
    PodInfo,
    ReplicaState,
)
from mooncake_operator.reconcile.decide.revisions import LastGood

pytestmark = pytest.mark.unit

OLD_IMAGE = "registry.invalid/vllm-mooncake:1"
NEW_IMAGE = "registry.invalid/vllm-mooncake:2"


def resource(
    image: str = NEW_IMAGE,
    *,
    strategy: str | None = "BlueGreen",
    on_failure: str = "Hold",
    enabled: bool = True,
) -> MooncakeServing:
    spec: dict[str, Any] = {
        "model": {"name": "tiny", "revision": "r1"},
        "engine": {"image": image, "blockSize": 32},
        "replicas": 2,
        "store": {"globalSegmentSize": "1GB", "localBufferSize": "512MB"},
        "canary": {"onFailure": on_failure, "enabled": enabled},
    }
    if strategy is not None:
        spec["rollout"] = {"strategy": strategy}
    return parse_resource(
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": "demo", "namespace": "ns", "generation": 2},
            "spec": spec,
        }
    )


T_OLD = replica_template_id(resource(OLD_IMAGE))
T_NEW = replica_template_id(resource(NEW_IMAGE))
BLUE = "demo-replica"  # the first set
GREEN = replica_set_name(resource(), T_NEW)


def revision_of(**changes: Any) -> str:
    return spec_hash(resource(**changes).spec)


OLD, NEW = revision_of(image=OLD_IMAGE), revision_of()
OLD_RB, NEW_RB = revision_of(image=OLD_IMAGE, on_failure="Rollback"), revision_of(on_failure="Rollback")


def run(verdict: str, *pods: PodInfo, revision: str = NEW, run_id: str = "run-2") -> CanaryStatus:
    return base.run(verdict, *pods, revision=revision, run_id=run_id)


def pod(replica_set: str, ordinal: int, *, traffic: str = "off", ready: bool = True) -> PodInfo:
    return PodInfo(f"{replica_set}-{ordinal}", f"uid-{replica_set}-{ordinal}", ready, False, "h", 0, traffic)


B0, B1 = pod(BLUE, 0, traffic="on"), pod(BLUE, 1, traffic="on")
G0, G1 = pod(GREEN, 0), pod(GREEN, 1)


def observed(
    active: tuple[PodInfo, ...], others: tuple[PodInfo, ...] = (), *, ready: bool = True
) -> Observation:
    replicas = ReplicaState(2, 2 if ready else 1, ready, "2/2 ready" if ready else "1/2 ready", active)
    return Observation(MasterState(True, "master ready", MASTER), replicas, others)


def status_serving(
    *serving: PodInfo, canary: Any = None, serving_set: str | None = BLUE
) -> MooncakeServingStatus:
    entries = [serving_entry(p) for p in serving]
    rollout = RolloutStatus(strategy="BlueGreen", serving_set=serving_set) if serving_set else None
    return MooncakeServingStatus(
        phase="Ready",
        canary=canary,
        last_good_revision=OLD,
        traffic=TrafficStatus(serving=len(entries), pods=entries),
        rollout=rollout,
    )


BLUE_PASS = run("Passed", B0, B1, revision=OLD, run_id="run-1")
SERVING_BLUE = status_serving(B0, B1, canary=BLUE_PASS)


# --- which set the spec is rendered into -----------------------------------------------------------


@pytest.mark.parametrize(
    ("res", "current", "live", "template", "expected"),
    [
        # A new resource: the first set simply comes up, under either strategy.
        (resource(), MooncakeServingStatus(), [], T_NEW, SetChoice("BlueGreen", BLUE)),
        # InPlace: the serving set rolls, whatever changed.
        (
            resource(strategy="InPlace"),
            SERVING_BLUE,
            [LiveSet(BLUE, T_OLD)],
            T_NEW,
            SetChoice("InPlace", BLUE),
        ),
        # Unset strategy is InPlace.
        (resource(strategy=None), SERVING_BLUE, [LiveSet(BLUE, T_OLD)], T_NEW, SetChoice("InPlace", BLUE)),
        # BlueGreen, same template (e.g. a canary or replica-count change): in place.
        (resource(), SERVING_BLUE, [LiveSet(BLUE, T_NEW)], T_NEW, SetChoice("BlueGreen", BLUE)),
        # BlueGreen, a new template while the set serves: a candidate beside it.
        (resource(), SERVING_BLUE, [LiveSet(BLUE, T_OLD)], T_NEW, SetChoice("BlueGreen", GREEN, BLUE)),
        # ... and on the next passes, with the candidate live.
        (
            resource(),
            SERVING_BLUE,
            [LiveSet(BLUE, T_OLD), LiveSet(GREEN, T_NEW)],
            T_NEW,
            SetChoice("BlueGreen", GREEN, BLUE),
        ),
        # Nothing serves users yet (the first set never passed): no one to protect, roll in place.
        (
            resource(),
            status_serving(canary=None),
            [LiveSet(BLUE, T_OLD)],
            T_NEW,
            SetChoice("BlueGreen", BLUE),
        ),
        # The spec goes back to the serving set's template: the candidate is removed.
        (
            resource(OLD_IMAGE),
            SERVING_BLUE,
            [LiveSet(BLUE, T_OLD), LiveSet(GREEN, T_NEW)],
            T_OLD,
            SetChoice("BlueGreen", BLUE, remove=(GREEN,)),
        ),
        # The spec changes again mid-rollout: a new candidate, the previous one removed.
        (
            resource(),
            SERVING_BLUE,
            [LiveSet(BLUE, T_OLD), LiveSet("demo-r0000000", "0000000aaaa")],
            T_NEW,
            SetChoice("BlueGreen", GREEN, BLUE, remove=("demo-r0000000",)),
        ),
        # After a switch the status names the candidate as serving: the old set, still found, is removed.
        (
            resource(),
            status_serving(G0, G1, serving_set=GREEN),
            [LiveSet(BLUE, T_OLD), LiveSet(GREEN, T_NEW)],
            T_NEW,
            SetChoice("BlueGreen", GREEN, remove=(BLUE,)),
        ),
        # A switch to InPlace mid-rollout: the serving set rolls, the candidate is removed.
        (
            resource(strategy="InPlace"),
            SERVING_BLUE,
            [LiveSet(BLUE, T_OLD), LiveSet(GREEN, T_NEW)],
            T_NEW,
            SetChoice("InPlace", BLUE, remove=(GREEN,)),
        ),
        # A set applied before sets carried their template: taken as the same (it rolls in place once).
        (resource(), SERVING_BLUE, [LiveSet(BLUE, None)], T_NEW, SetChoice("BlueGreen", BLUE)),
    ],
    ids=[
        "first set",
        "InPlace rolls",
        "unset is InPlace",
        "same template in place",
        "new template: candidate",
        "candidate live",
        "nothing serves: in place",
        "revert removes the candidate",
        "changed again: new candidate",
        "after the switch: old removed",
        "InPlace mid-rollout",
        "unannotated set",
    ],
)
def test_choose_sets(
    res: MooncakeServing,
    current: MooncakeServingStatus,
    live: list[LiveSet],
    template: str,
    expected: SetChoice,
) -> None:
    assert choose.choose_sets(res, current, live, template) == expected


def test_candidate_names_fit_the_pod_label_limit() -> None:
    """A StatefulSet's pods carry controller-revision-hash "<set>-<10 chars>": at most 63 characters."""
    longest = resource().model_copy(
        update={"metadata": resource().metadata.model_copy(update={"name": "n" * MAX_NAME_LENGTH})}
    )
    name = replica_set_name(longest, T_NEW)
    assert len(f"{name}-0123456789") <= 63
    assert GREEN != BLUE and GREEN.startswith("demo-r")


# --- the rollout, pass by pass --------------------------------------------------------------------


def decide(
    res: MooncakeServing,
    current: MooncakeServingStatus,
    observation: Observation,
    *,
    sets: SetChoice,
    fresh: CanaryRun | None = None,
    last_good: LastGood | None = None,
) -> Decision:
    last_good = last_good or LastGood(OLD, resource(OLD_IMAGE).spec)
    return plan.decide(snapshot(res, current, observation, last_good, sets=sets), fresh)


CANDIDATE = SetChoice("BlueGreen", GREEN, BLUE)


def removed(decision: Decision) -> tuple[str, ...]:
    return next((a.names for a in decision.actions if isinstance(a, RemoveSets)), ())


def serving_pods(decision: Decision) -> set[str]:
    assert decision.status.traffic is not None
    return {entry.name for entry in decision.status.traffic.pods if entry.serving}


def test_a_starting_candidate_leaves_the_serving_set_serving() -> None:
    decision = decide(resource(), SERVING_BLUE, observed((G0,), (B0, B1), ready=False), sets=CANDIDATE)
    assert decision.status.phase == "Deploying"
    assert serving_pods(decision) == {B0.name, B1.name}
    assert labels(decision) == {}
    assert removed(decision) == ()
    rollout = decision.status.rollout
    assert rollout is not None
    assert (rollout.serving_set, rollout.candidate_set, rollout.candidate_phase) == (BLUE, GREEN, "Deploying")


def test_the_canary_runs_against_the_candidates_pods_only() -> None:
    decision = decide(resource(), SERVING_BLUE, observed((G0, G1), (B0, B1)), sets=CANDIDATE)
    assert decision.canary is not None
    assert decision.canary.target.replica_pods == [G0.identity, G1.identity]
    assert decision.canary.target.revision == NEW
    assert decision.status.rollout is not None and decision.status.rollout.candidate_phase == "Canary"
    assert serving_pods(decision) == {B0.name, B1.name}
    assert labels(decision) == {}


def test_a_pass_switches_the_client_service_then_removes_the_old_set() -> None:
    fresh = CanaryRun(run("Passed", G0, G1))
    decision = decide(resource(), SERVING_BLUE, observed((G0, G1), (B0, B1)), sets=CANDIDATE, fresh=fresh)
    assert decision.status.phase == "Ready"
    assert serving_pods(decision) == {G0.name, G1.name}
    assert labels(decision) == {G0.name: "on", G1.name: "on", B0.name: "off", B1.name: "off"}
    # The status names the new set as serving (written before the labels; the old set goes last).
    rollout = decision.status.rollout
    assert rollout is not None
    assert (rollout.serving_set, rollout.candidate_set, rollout.candidate_phase) == (GREEN, None, None)
    assert BLUE in rollout.message
    assert removed(decision) == (BLUE,)
    # The record, the status naming the new set, the labels (new pods on first), then the old set goes.
    assert summary(decision.actions) == (
        ("record", NEW),
        ("status", "Ready", "Ready"),
        ("event", "Ready", "Normal"),
        ("traffic", {G0.name: "on", G1.name: "on", B0.name: "off", B1.name: "off"}),
        ("remove", (BLUE,)),
    )
    assert decision.outcome is not None and decision.outcome.result is ReconcileResult.READY


def test_a_pass_over_other_pods_than_the_candidates_does_not_switch() -> None:
    stale = run("Passed", pod(GREEN, 0), PodInfo(f"{GREEN}-1", "uid-replaced", True, False, "h", 0, "off"))
    current = status_serving(B0, B1, canary=stale)
    decision = decide(resource(), current, observed((G0, G1), (B0, B1)), sets=CANDIDATE)
    assert decision.canary is not None  # the replaced pod must be proven first
    assert removed(decision) == ()
    assert serving_pods(decision) == {B0.name, B1.name}


def test_a_failure_with_hold_keeps_both_sets_and_the_old_one_serving() -> None:
    fresh = CanaryRun(run("Failed", G0, G1), blamed=(G1.name,))
    decision = decide(resource(), SERVING_BLUE, observed((G0, G1), (B0, B1)), sets=CANDIDATE, fresh=fresh)
    assert decision.status.phase == "CanaryFailed"
    assert serving_pods(decision) == {B0.name, B1.name}
    assert labels(decision) == {}
    assert removed(decision) == ()
    assert decision.status.failed_revision is None
    rollout = decision.status.rollout
    assert rollout is not None
    assert (rollout.serving_set, rollout.candidate_set, rollout.candidate_phase) == (BLUE, GREEN, "Held")
    assert GREEN in rollout.message and "inspection" in rollout.message


def test_a_held_candidate_stays_held_on_later_passes() -> None:
    failed = run("Failed", G0, G1)
    current = status_serving(B0, B1, canary=failed)
    decision = decide(resource(), current, observed((G0, G1), (B0, B1)), sets=CANDIDATE)
    assert decision.canary is None
    assert decision.status.rollout is not None and decision.status.rollout.candidate_phase == "Held"
    assert serving_pods(decision) == {B0.name, B1.name}
    assert removed(decision) == ()


def test_a_failure_with_rollback_removes_the_candidate() -> None:
    res = resource(on_failure="Rollback")
    fresh = CanaryRun(run("Failed", G0, G1, revision=NEW_RB), blamed=(G1.name,))
    last_good = LastGood(OLD_RB, resource(OLD_IMAGE, on_failure="Rollback").spec)
    current = status_serving(B0, B1, canary=BLUE_PASS)
    decision = decide(
        res, current, observed((G0, G1), (B0, B1)), sets=CANDIDATE, fresh=fresh, last_good=last_good
    )
    assert decision.status.failed_revision == NEW_RB  # the next pass renders the last good spec
    assert summary(decision.actions) == (
        ("status", "Deploying", "RollingBack"),
        ("event", "RollingBack", "Warning"),
        ("remove", (GREEN,)),
    )
    assert serving_pods(decision) == {B0.name, B1.name}
    assert labels(decision) == {}
    rollout = decision.status.rollout
    assert rollout is not None
    assert (rollout.serving_set, rollout.candidate_set) == (BLUE, None)
    assert "Rollback" in rollout.message
    # The next pass renders the last good spec: its template is the serving set's, so no candidate.
    after = choose.choose_spec_revision(res, decision.status, last_good)
    template = replica_template_id(res.model_copy(update={"spec": after.spec}))
    assert template == T_OLD
    sets = choose.choose_sets(res, decision.status, [LiveSet(BLUE, T_OLD)], template)
    assert sets == SetChoice("BlueGreen", BLUE)


def test_inconclusive_never_switches() -> None:
    fresh = CanaryRun(run("Inconclusive", G0, G1))
    decision = decide(resource(), SERVING_BLUE, observed((G0, G1), (B0, B1)), sets=CANDIDATE, fresh=fresh)
    assert decision.status.phase == "CanaryInconclusive"
    assert serving_pods(decision) == {B0.name, B1.name}
    assert labels(decision) == {}
    assert removed(decision) == ()
    rollout = decision.status.rollout
    assert rollout is not None and rollout.candidate_phase == "Inconclusive"
    assert decision.outcome is not None and decision.outcome.retry_after == TIMING.inconclusive_retry_seconds


def test_a_reverted_spec_removes_the_candidate_and_keeps_the_old_pods_serving() -> None:
    sets = SetChoice("BlueGreen", BLUE, remove=(GREEN,))
    decision = decide(resource(OLD_IMAGE), SERVING_BLUE, observed((B0, B1), (G0, G1)), sets=sets)
    assert removed(decision) == (GREEN,)
    assert serving_pods(decision) == {B0.name, B1.name}
    assert {name: value for name, value in labels(decision).items() if value == "on"} == {}


def test_without_a_canary_the_candidate_is_switched_to_once_ready() -> None:
    res = resource(enabled=False)
    waiting = decide(res, SERVING_BLUE, observed((G0,), (B0, B1), ready=False), sets=CANDIDATE)
    assert serving_pods(waiting) == {B0.name, B1.name} and removed(waiting) == ()
    ready = decide(res, SERVING_BLUE, observed((G0, G1), (B0, B1)), sets=CANDIDATE)
    assert serving_pods(ready) == {G0.name, G1.name}
    assert removed(ready) == (BLUE,)


def test_in_place_keeps_todays_status_shape() -> None:
    res = resource(strategy="InPlace")
    fresh = CanaryRun(run("Passed", B0, B1))
    decision = decide(res, SERVING_BLUE, observed((B0, B1)), sets=SetChoice("InPlace", BLUE), fresh=fresh)
    assert decision.status.rollout == RolloutStatus(strategy="InPlace", serving_set=BLUE)
    assert removed(decision) == ()


def test_a_serving_set_pod_replaced_mid_rollout_stays_out_and_says_why() -> None:
    replaced = PodInfo(f"{BLUE}-1", "uid-new", True, False, "h", 0, "on")
    decision = decide(resource(), SERVING_BLUE, observed((G0,), (B0, replaced), ready=False), sets=CANDIDATE)
    assert serving_pods(decision) == {B0.name}
    assert labels(decision) == {replaced.name: "off"}
    assert decision.status.traffic is not None
    entry = next(e for e in decision.status.traffic.pods if e.uid == "uid-new")
    assert "not proven" in entry.reason and BLUE in entry.reason
