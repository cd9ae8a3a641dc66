"""The planner's decisions, table by table: the exact actions, what the status says, who serves users."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from mooncake_operator.api.group import API_VERSION, KIND, RERUN_CANARY_ANNOTATION
from mooncake_operator.api.resource import MooncakeServing, parse_resource
from mooncake_operator.api.status import (
    CanaryStatus,
    CanaryTarget,
    MooncakeServingStatus,
    PodTraffic,
    TrafficStatus,
)
from mooncake_operator.build.digests import spec_hash
from mooncake_operator.reconcile.decide import actions, choose, plan
from mooncake_operator.reconcile.decide.actions import Action, Decision, Outcome, ReconcileResult
from mooncake_operator.reconcile.decide.canary_run import CanaryRun
from mooncake_operator.reconcile.decide.choose import SetChoice
from mooncake_operator.reconcile.decide.conditions import READY, find
from mooncake_operator.reconcile.decide.observe import MasterState, Observation, PodInfo, ReplicaState
from mooncake_operator.reconcile.decide.plan import Snapshot, Timing
from mooncake_operator.reconcile.decide.revisions import LastGood, last_good_manifest

pytestmark = pytest.mark.unit

NOW = datetime(2026, 12, 1, 3, 0, tzinfo=UTC)
TIMING = Timing(retry_delay_seconds=10, inconclusive_retry_seconds=60, leader_check_seconds=30)
OLD_IMAGE = "registry.invalid/vllm-mooncake:1"
NEW_IMAGE = "registry.invalid/vllm-mooncake:2"
MASTER = PodInfo("demo-master-x", "master-uid", True, False, "m1", 0, None)


def resource(
    image: str = NEW_IMAGE, *, on_failure: str = "Hold", enabled: bool = True, rerun: str | None = None
) -> MooncakeServing:
    annotations = {RERUN_CANARY_ANNOTATION: rerun} if rerun else {}
    return parse_resource(
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": "demo", "namespace": "ns", "generation": 2, "annotations": annotations},
            "spec": {
                "model": {"name": "tiny", "revision": "r1"},
                "engine": {"image": image, "blockSize": 32},
                "replicas": 2,
                "store": {"globalSegmentSize": "1GB", "localBufferSize": "512MB"},
                "canary": {"onFailure": on_failure, "enabled": enabled},
            },
        }
    )


OLD = spec_hash(resource(OLD_IMAGE).spec)
NEW = spec_hash(resource(NEW_IMAGE).spec)
LAST_GOOD_OLD = LastGood(OLD, resource(OLD_IMAGE).spec)
# onFailure is part of the spec, so of its digest.
OLD_RB = spec_hash(resource(OLD_IMAGE, on_failure="Rollback").spec)
NEW_RB = spec_hash(resource(NEW_IMAGE, on_failure="Rollback").spec)
LAST_GOOD_OLD_RB = LastGood(OLD_RB, resource(OLD_IMAGE, on_failure="Rollback").spec)


def pod(
    ordinal: int, generation: str = "new", *, instance: str = "a", ready: bool = True, traffic: str = "off"
) -> PodInfo:
    """Replica pod `ordinal` of a template generation (its controller-revision-hash); `instance` tells apart
    pods recreated under the same name (their UIDs)."""
    name = f"demo-replica-{ordinal}"
    uid = f"uid-{ordinal}-{generation}-{instance}"
    return PodInfo(name, uid, ready, False, f"hash-{generation}", 0, traffic)


def observation(*pods: PodInfo, ready: bool = True) -> Observation:
    """Rolled out with every replica Ready, or (ready=False) a rollout in progress / a replica lost."""
    replicas = ReplicaState(2, 2 if ready else 1, ready, "2/2 ready" if ready else "1/2 ready", pods)
    return Observation(MasterState(True, "master ready", MASTER), replicas)


def target(*pods: PodInfo, revision: str = NEW, rerun: str | None = None) -> CanaryTarget:
    return CanaryTarget(
        revision=revision,
        generation=2,
        replica_pods=[p.identity for p in pods],
        master_pod=MASTER.uid,
        master_restarts=0,
        rerun=rerun,
    )


def run(
    verdict: str, *pods: PodInfo, revision: str = NEW, run_id: str = "run-2", **extra: Any
) -> CanaryStatus:
    finished = (NOW - timedelta(seconds=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return CanaryStatus(
        run_id=run_id,
        verdict=verdict,
        reason="because",
        finished_at=finished,
        target=target(*pods, revision=revision, **extra),
    )


def serving_entry(p: PodInfo, run_id: str = "run-1") -> PodTraffic:
    return PodTraffic(
        name=p.name, uid=p.uid, revision=p.template_hash, serving=True, reason="proven", proven_by=run_id
    )


def stored(
    *serving: PodInfo,
    canary: CanaryStatus | None = None,
    last_good: str | None = OLD,
    failed: str | None = None,
    held: tuple[str, ...] = (),
) -> MooncakeServingStatus:
    entries = [serving_entry(p) for p in serving]
    return MooncakeServingStatus(
        phase="Ready",
        canary=canary,
        last_good_revision=last_good,
        failed_revision=failed,
        out_of_traffic=list(held),
        traffic=TrafficStatus(serving=len(entries), pods=entries),
    )


@dataclass(frozen=True)
class Case:
    resource: MooncakeServing
    current: MooncakeServingStatus
    observation: Observation
    last_good: LastGood | None = LAST_GOOD_OLD
    fresh: CanaryRun | None = None
    # expected: the actions in order (see `summary`), and the status they write
    actions: tuple[tuple[Any, ...], ...] = ()
    phase: str = "Ready"
    reason: str = "Ready"
    serving: tuple[str, ...] = ()  # pods in traffic afterwards
    result: ReconcileResult | None = ReconcileResult.READY
    retry_after: float | None = None


def snapshot(
    res: MooncakeServing,
    current: MooncakeServingStatus,
    observed: Observation,
    last_good: LastGood | None,
    *,
    sets: SetChoice | None = None,
    **extra: Any,
) -> Snapshot:
    """What a pass would hand the planner: no replica set found yet (the spec's own), unless `sets`."""
    rendering = choose.rendering(res, current, last_good, ())
    if sets is not None:
        rendering = dataclasses.replace(rendering, sets=sets)
    return Snapshot(res, current, rendering, observed, NOW, TIMING, **extra)


def decide(case: Case) -> Decision:
    return plan.decide(snapshot(case.resource, case.current, case.observation, case.last_good), case.fresh)


def summary(ordered: Sequence[Action]) -> tuple[tuple[Any, ...], ...]:
    """Each action by what it does: the status by phase and Ready reason, the record by revision."""

    def one(action: Action) -> tuple[Any, ...]:
        match action:
            case actions.WriteStatus(status=written):
                ready = find(written.conditions, READY)
                return ("status", written.phase, ready.reason if ready else None)
            case actions.PostEvent(reason=reason, type=kind):
                return ("event", reason, kind)
            case actions.RecordLastGood(spec=spec):
                return ("record", spec_hash(spec))
            case actions.SetTraffic(labels=labels):
                return ("traffic", dict(labels))
            case actions.RemoveSets(names=names):
                return ("remove", names)
            case actions.RunCanary(target=ordered):
                return ("canary", ordered.revision)
        raise AssertionError(action)

    return tuple(one(action) for action in ordered)


def labels(decision: Decision) -> dict[str, str]:
    return next((dict(a.labels) for a in decision.actions if isinstance(a, actions.SetTraffic)), {})


P0, P1 = pod(0), pod(1)
P0_ON, P1_ON = pod(0, traffic="on"), pod(1, traffic="on")
OLD0, OLD1 = pod(0, "old", traffic="on"), pod(1, "old", traffic="on")
OLD_PASS = run("Passed", OLD0, OLD1, revision=OLD, run_id="run-1")

CASES = {
    # A new revision's pods are ready: they start out of traffic and the canary is ordered.
    "new revision ready: canary ordered, pods stay off": Case(
        resource(),
        stored(canary=OLD_PASS),
        observation(P0, P1),
        phase="Canary",
        reason="CanaryRunning",
        result=None,
        actions=(
            ("status", "Canary", "CanaryRunning"),
            ("event", "CanaryRunning", "Normal"),
            ("canary", NEW),
        ),
    ),
    # The pass proves both pods at their revision: they get traffic, the spec is recorded as last good.
    "pass: proven pods get traffic, last good recorded": Case(
        resource(),
        stored(canary=OLD_PASS),
        observation(P0, P1),
        fresh=CanaryRun(run("Passed", P0, P1)),
        serving=(P0.name, P1.name),
        actions=(
            ("record", NEW),
            ("status", "Ready", "Ready"),
            ("event", "Ready", "Normal"),
            ("traffic", {P0.name: "on", P1.name: "on"}),
        ),
    ),
    "Hold, first rollout fails: nobody was proven, the blamed pod is held": Case(
        resource(),
        stored(canary=None, last_good=None),
        observation(P0, P1),
        last_good=None,
        fresh=CanaryRun(run("Failed", P0, P1), blamed=(P1.name,)),
        phase="CanaryFailed",
        reason="CanaryFailed",
        result=ReconcileResult.CANARY_FAILED,
        actions=(("status", "CanaryFailed", "CanaryFailed"), ("event", "CanaryFailed", "Warning")),
    ),
    "Hold, a re-run of a proven revision fails: only the blamed pod leaves traffic": Case(
        resource(rerun="again"),
        stored(P0_ON, P1_ON, canary=run("Passed", P0_ON, P1_ON)),
        observation(P0_ON, P1_ON),
        fresh=CanaryRun(run("Failed", P0_ON, P1_ON, rerun="again"), blamed=(P1.name,)),
        phase="CanaryFailed",
        reason="CanaryFailed",
        serving=(P0.name,),
        result=ReconcileResult.CANARY_FAILED,
        actions=(
            ("status", "CanaryFailed", "CanaryFailed"),
            ("event", "CanaryFailed", "Warning"),
            ("traffic", {P1.name: "off"}),
        ),
    ),
    "Inconclusive keeps the new revision's pods out and retries later": Case(
        resource(),
        stored(canary=OLD_PASS),
        observation(P0, P1),
        fresh=CanaryRun(run("Inconclusive", P0, P1)),
        phase="CanaryInconclusive",
        reason="CanaryInconclusive",
        result=ReconcileResult.CANARY_INCONCLUSIVE,
        retry_after=TIMING.inconclusive_retry_seconds,
        actions=(
            ("status", "CanaryInconclusive", "CanaryInconclusive"),
            ("event", "CanaryInconclusive", "Warning"),
        ),
    ),
    "Inconclusive re-run of proven pods leaves them serving": Case(
        resource(rerun="again"),
        stored(P0_ON, P1_ON, canary=run("Passed", P0_ON, P1_ON)),
        observation(P0_ON, P1_ON),
        fresh=CanaryRun(run("Inconclusive", P0_ON, P1_ON, rerun="again")),
        phase="CanaryInconclusive",
        reason="CanaryInconclusive",
        serving=(P0.name, P1.name),
        result=ReconcileResult.CANARY_INCONCLUSIVE,
        retry_after=TIMING.inconclusive_retry_seconds,
        actions=(
            ("status", "CanaryInconclusive", "CanaryInconclusive"),
            ("event", "CanaryInconclusive", "Warning"),
        ),
    ),
    "Rollback: the spec's revision failed, a different good one is stored": Case(
        resource(on_failure="Rollback"),
        stored(canary=OLD_PASS),
        observation(P0, P1),
        last_good=LAST_GOOD_OLD_RB,
        fresh=CanaryRun(run("Failed", P0, P1, revision=NEW_RB), blamed=(P1.name,)),
        phase="Deploying",
        reason="RollingBack",
        result=ReconcileResult.ROLLED_BACK,
        retry_after=1.0,
        actions=(("status", "Deploying", "RollingBack"), ("event", "RollingBack", "Warning")),
    ),
    "Rollback without a last good revision behaves as Hold": Case(
        resource(on_failure="Rollback"),
        stored(canary=None, last_good=None),
        observation(P0, P1),
        last_good=None,
        fresh=CanaryRun(run("Failed", P0, P1, revision=NEW_RB), blamed=(P1.name,)),
        phase="CanaryFailed",
        reason="CanaryFailed",
        result=ReconcileResult.CANARY_FAILED,
        actions=(("status", "CanaryFailed", "CanaryFailed"), ("event", "CanaryFailed", "Warning")),
    ),
    # The next pass renders the last good spec (OLD); its fresh pods pass: Degraded, serving, not recorded.
    "rolled back and proven again: Degraded, serving, nothing recorded": Case(
        resource(on_failure="Rollback"),
        stored(canary=run("Failed", P0, P1, revision=NEW_RB), failed=NEW_RB, held=(P1.name,)),
        observation(P0, P1),
        last_good=LAST_GOOD_OLD_RB,
        fresh=CanaryRun(run("Passed", P0, P1, revision=OLD_RB)),
        phase="Degraded",
        reason="RolledBack",
        serving=(P0.name, P1.name),
        result=ReconcileResult.ROLLED_BACK,
        actions=(
            ("status", "Degraded", "RolledBack"),
            ("event", "RolledBack", "Warning"),
            ("traffic", {P0.name: "on", P1.name: "on"}),
        ),
    ),
    "replica loss: the proven pod left keeps serving, the resource is Degraded": Case(
        resource(),
        stored(P0_ON, P1_ON, canary=run("Passed", P0_ON, P1_ON), last_good=NEW),
        observation(P0_ON, ready=False),
        last_good=LastGood(NEW, resource().spec),
        phase="Degraded",
        reason="ReplicasLost",
        serving=(P0.name,),
        result=ReconcileResult.WAITING,
        retry_after=TIMING.retry_delay_seconds,
        actions=(("status", "Degraded", "ReplicasLost"), ("event", "ReplicasLost", "Warning")),
    ),
    "a replaced pod waits for a canary even at a proven revision": Case(
        resource(),
        stored(P0_ON, P1_ON, canary=run("Passed", P0_ON, P1_ON), last_good=NEW),
        observation(P0_ON, pod(1, instance="b")),
        last_good=LastGood(NEW, resource().spec),
        phase="Canary",
        reason="CanaryRunning",
        serving=(P0.name,),
        result=None,
        actions=(
            ("status", "Canary", "CanaryRunning"),
            ("event", "CanaryRunning", "Normal"),
            ("canary", NEW),
        ),
    ),
    "in-place rollout: the proven revision's pods serve until replaced": Case(
        resource(),
        stored(OLD0, OLD1, canary=OLD_PASS),
        observation(OLD0, P1, ready=False),
        phase="Deploying",
        reason="Deploying",
        serving=(OLD0.name,),
        result=ReconcileResult.WAITING,
        retry_after=TIMING.retry_delay_seconds,
        actions=(("status", "Deploying", "Deploying"), ("event", "Deploying", "Normal")),
    ),
    "a pod replaced during the run is not proven by it": Case(
        resource(),
        stored(canary=OLD_PASS),
        observation(P0, pod(1, instance="b")),
        fresh=CanaryRun(run("Passed", P0, P1)),
        serving=(P0.name,),
        actions=(
            ("record", NEW),
            ("status", "Ready", "Ready"),
            ("event", "Ready", "Normal"),
            ("traffic", {P0.name: "on"}),
        ),
    ),
    "rerun annotation orders a run against proven pods, which keep serving meanwhile": Case(
        resource(rerun="now"),
        stored(P0_ON, P1_ON, canary=run("Passed", P0_ON, P1_ON), last_good=NEW),
        observation(P0_ON, P1_ON),
        last_good=LastGood(NEW, resource().spec),
        phase="Canary",
        reason="CanaryRunning",
        serving=(P0.name, P1.name),
        result=None,
        actions=(
            ("status", "Canary", "CanaryRunning"),
            ("event", "CanaryRunning", "Normal"),
            ("canary", NEW),
        ),
    ),
    "nothing changed: no run, no label write, nothing recorded": Case(
        resource(),
        stored(P0_ON, P1_ON, canary=run("Passed", P0_ON, P1_ON), last_good=NEW),
        observation(P0_ON, P1_ON),
        last_good=LastGood(NEW, resource().spec),
        serving=(P0.name, P1.name),
        actions=(("status", "Ready", "Ready"),),
    ),
    "a lost last-good record is written again": Case(
        resource(),
        stored(P0_ON, P1_ON, canary=run("Passed", P0_ON, P1_ON), last_good=NEW),
        observation(P0_ON, P1_ON),
        last_good=None,
        serving=(P0.name, P1.name),
        actions=(("record", NEW), ("status", "Ready", "Ready")),
    ),
    "canary disabled: every pod serves once Ready, nothing is held": Case(
        resource(enabled=False),
        stored(canary=None, held=(P1.name,)),
        observation(P0, P1),
        serving=(P0.name, P1.name),
        actions=(("status", "Ready", "Ready"), ("traffic", {P0.name: "on", P1.name: "on"})),
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_plan(case: Case) -> None:
    decided = decide(case)
    ready = find(decided.status.conditions, READY)
    assert ready is not None
    assert (decided.status.phase, ready.reason) == (case.phase, case.reason), ready.message
    assert summary(decided.actions) == case.actions
    traffic = decided.status.traffic
    assert traffic is not None
    assert tuple(p.name for p in traffic.pods if p.serving) == case.serving
    assert traffic.serving == len(case.serving)
    if case.result is None:
        assert decided.outcome is None
    else:
        assert decided.outcome is not None
        assert (decided.outcome.result, decided.outcome.retry_after) == (case.result, case.retry_after)


def test_the_decision_carries_its_timers() -> None:
    """The worker sleeps on the decision's timers (it reads no spec of its own): the canary interval
    falls due counted from the last finished run; a single master needs no leader check."""
    settled = decide(CASES["nothing changed: no run, no label write, nothing recorded"]).outcome
    assert settled is not None and (settled.canary_due_in, settled.leader_check_in) == (None, None)
    assert settled.sleep_seconds(600) == 600
    wire = resource().to_wire()
    wire["spec"]["canary"]["intervalSeconds"] = 60
    every_minute = parse_resource(wire)
    revision = spec_hash(every_minute.spec)
    last = run("Passed", P0_ON, P1_ON, revision=revision)  # finished 5 s before NOW
    case = Case(
        every_minute,
        stored(P0_ON, P1_ON, canary=last, last_good=revision),
        observation(P0_ON, P1_ON),
        last_good=LastGood(revision, every_minute.spec),
    )
    timed = decide(case).outcome
    assert timed is not None and timed.result is ReconcileResult.READY
    assert timed.canary_due_in == 55 and timed.sleep_seconds(600) == 55
    assert Outcome(ReconcileResult.WAITING, retry_after=10, canary_due_in=55).sleep_seconds(600) == 10
    assert Outcome(ReconcileResult.READY, leader_check_in=30).sleep_seconds(20) == 20


def test_the_runs_own_events_come_first_after_the_run() -> None:
    """A canary run's events (a pass over a benign divergence) are actions of the decision after it,
    before its status write."""
    case = CASES["pass: proven pods get traffic, last good recorded"]
    benign = actions.PostEvent("CanaryBenignDivergence", "run run-2: 1 pair(s) passed over ...", "Normal")
    assert case.fresh is not None
    with_event = dataclasses.replace(case, fresh=dataclasses.replace(case.fresh, events=(benign,)))
    decided = decide(with_event)
    assert decided.actions[0] == benign
    assert decided.actions[1:] == decide(case).actions


def test_every_pod_says_why_it_serves_or_not() -> None:
    passed = decide(CASES["pass: proven pods get traffic, last good recorded"]).status.traffic
    assert passed is not None
    assert [(p.proven_by, p.revision) for p in passed.pods] == [("run-2", "hash-new")] * 2
    assert passed.pods[0].reason == "proven by canary run run-2 at pod template hash-new"
    held = decide(CASES["Hold, first rollout fails: nobody was proven, the blamed pod is held"]).status
    assert held.out_of_traffic == [P1.name]
    assert held.traffic is not None
    reasons = {p.name: p.reason for p in held.traffic.pods}
    assert reasons[P0.name] == "not proven: canary run run-2 at pod template hash-new was Failed"
    assert reasons[P1.name].startswith("held: a failed canary blamed this replica")
    waiting = decide(CASES["new revision ready: canary ordered, pods stay off"]).status.traffic
    assert waiting is not None
    assert {p.reason for p in waiting.pods} == {
        "new pod at pod template hash-new: waits for a canary to prove it"
    }


def test_a_pass_releases_held_pods_and_a_replaced_held_pod_stays_held() -> None:
    current = stored(P0_ON, canary=run("Failed", P0_ON, P1), held=(P1.name,))
    replaced = decide(Case(resource(rerun="x"), current, observation(P0_ON, pod(1, instance="b")))).status
    assert replaced.out_of_traffic == [P1.name]
    fresh = CanaryRun(run("Passed", P0_ON, P1, rerun="x"))
    released = decide(Case(resource(rerun="x"), current, observation(P0_ON, P1), fresh=fresh)).status
    assert released.out_of_traffic == []
    assert released.traffic is not None and released.traffic.serving == 2


def test_the_rollback_records_the_failed_revision_and_keeps_the_failed_run() -> None:
    decided = decide(CASES["Rollback: the spec's revision failed, a different good one is stored"])
    assert decided.status.failed_revision == NEW_RB
    assert decided.status.serving_revision == NEW_RB  # the next pass renders the last good one
    assert decided.status.canary is not None and decided.status.canary.verdict == "Failed"
    assert decided.status.out_of_traffic == [P1.name]
    # ... and the next pass chooses the last good spec.
    choice = choose.choose_spec_revision(resource(on_failure="Rollback"), decided.status, LAST_GOOD_OLD_RB)
    assert (choice.revisions.serving, choice.revisions.failed) == (OLD_RB, NEW_RB)
    assert choice.spec.engine.image == OLD_IMAGE


@pytest.mark.parametrize(
    ("served", "failed", "last_good", "serving"),
    [
        (resource(on_failure="Rollback"), NEW_RB, LAST_GOOD_OLD_RB, OLD_RB),  # stands rolled back
        (resource(on_failure="Rollback", rerun="retry"), NEW_RB, LAST_GOOD_OLD_RB, NEW_RB),  # a retry
        (resource(on_failure="Hold"), NEW_RB, LAST_GOOD_OLD_RB, NEW),  # Rollback turned off: the spec
        (resource(OLD_IMAGE, on_failure="Rollback"), NEW_RB, LAST_GOOD_OLD_RB, OLD_RB),  # a new spec
        (resource(on_failure="Rollback"), NEW_RB, None, NEW_RB),  # nothing to roll back to
        (resource(on_failure="Rollback"), None, LAST_GOOD_OLD_RB, NEW_RB),  # nothing failed
    ],
)
def test_choose_revision(
    served: MooncakeServing, failed: str | None, last_good: LastGood | None, serving: str
) -> None:
    current = MooncakeServingStatus(failed_revision=failed, canary=run("Failed", P0, P1, revision=NEW_RB))
    assert choose.choose_spec_revision(served, current, last_good).revisions.serving == serving


def test_only_the_recorded_traffic_says_who_serves() -> None:
    """Who serves is read from status.traffic alone (no fallback to the last run's target): a status
    without that record proves no pod, whatever its labels say."""
    current = MooncakeServingStatus(
        phase="Ready", canary=run("Passed", P0_ON, P1_ON), last_good_revision=NEW, out_of_traffic=[]
    )
    decided = decide(
        Case(resource(), current, observation(P0_ON, P1_ON), last_good=LastGood(NEW, resource().spec))
    )
    assert labels(decided) == {P0.name: "off", P1.name: "off"}
    assert decided.status.traffic is not None and decided.status.traffic.serving == 0


def test_each_label_is_for_the_pod_instance_observed() -> None:
    """The label write carries the observed uid (a precondition at the API server): a pod created again
    under its name after the snapshot is not the pod this decision is about."""
    current = MooncakeServingStatus(
        phase="Ready", canary=run("Passed", P0_ON, P1_ON), last_good_revision=NEW, out_of_traffic=[]
    )
    recreated = pod(0, instance="b", traffic="on")
    decided = decide(
        Case(resource(), current, observation(recreated, P1_ON), last_good=LastGood(NEW, resource().spec))
    )
    (write,) = [a for a in decided.actions if isinstance(a, actions.SetTraffic)]
    assert dict(write.labels) == {P0.name: "off", P1.name: "off"}
    assert dict(write.uids) == {P0.name: recreated.uid, P1.name: P1_ON.uid}


def test_an_invalid_spec_says_why_and_posts_an_event_when_what_is_wrong_changes() -> None:
    stored = MooncakeServingStatus(phase="Ready")
    first = plan.invalid(stored, ["spec.replicas: too few"], generation=3, now=NOW)
    assert summary(first.actions) == (
        ("status", "Invalid", "InvalidSpec"),
        ("event", "InvalidSpec", "Warning"),
    )
    assert first.outcome == Outcome(ReconcileResult.INVALID, "spec.replicas: too few")
    assert first.status.observed_generation == 3
    same = plan.invalid(first.status, ["spec.replicas: too few"], generation=3, now=NOW)
    assert summary(same.actions) == (("status", "Invalid", "InvalidSpec"),)
    other = plan.invalid(first.status, ["spec.model: missing"], generation=4, now=NOW)
    assert summary(other.actions) == (
        ("status", "Invalid", "InvalidSpec"),
        ("event", "InvalidSpec", "Warning"),
    )


def test_a_refused_child_keeps_the_phase_and_is_retried() -> None:
    stored = MooncakeServingStatus(phase="Ready", last_good_revision=NEW)
    refused = plan.apply_failed(
        resource(), stored, "applying Service/demo failed: 422", generation=2, now=NOW, timing=TIMING
    )
    assert summary(refused.actions) == (("status", "Ready", "ApplyFailed"),)
    assert refused.status.last_good_revision == NEW  # every other field kept
    assert refused.outcome == Outcome(
        ReconcileResult.ERROR, "applying Service/demo failed: 422", TIMING.retry_delay_seconds
    )


def test_a_changed_last_good_record_is_not_trusted_and_a_rollback_says_so() -> None:
    """The planner verifies the NAME-last-good ConfigMap against the status's record before using it."""
    res = resource(on_failure="Rollback")
    record = last_good_manifest(res, resource(OLD_IMAGE, on_failure="Rollback").spec, owner_uid="u")
    current = stored(canary=OLD_PASS, last_good=OLD_RB)
    trusted = choose.choose(res, current, record, ())
    assert trusted.last_good == LAST_GOOD_OLD_RB and trusted.last_good_refused is None
    edited = choose.choose(res, current.model_copy(update={"last_good_revision": "0123"}), record, ())
    assert edited.last_good is None and edited.last_good_refused is not None
    assert "changed after the canary proved it" in edited.last_good_refused
    fresh = CanaryRun(run("Failed", P0, P1, revision=NEW_RB), blamed=(P1.name,))
    snap = Snapshot(res, current, edited, observation(P0, P1), NOW, TIMING)
    decided = plan.decide(snap, fresh)
    assert summary(decided.actions) == (
        ("status", "CanaryFailed", "CanaryFailed"),
        ("event", "CanaryFailed", "Warning"),
    )
    ready = find(decided.status.conditions, READY)
    assert ready is not None and "Rollback refused" in ready.message
