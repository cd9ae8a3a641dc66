"""The reconcile's decisions, as pure functions: what to render, what the status says, who serves users,
whether a canary runs, whether to record the last good revision or roll back, when to try again.

`core` reads (the resource, the last good record, the children), asks `choose_revision` what to render,
applies it, observes, asks `plan` what to do, and does it: record the last good revision, write the
status, then set the traffic labels (in that order: a status write that fails leaves every label as it
was, so it can never put a held replica back in traffic). When the plan orders a canary, `core` runs it
and asks `plan` again with the fresh run.

Traffic (the client Service selects `traffic: on`): a replica pod starts `off` (pod template) and serves
only after a passing canary covered it at its current revision: the run's target lists it as `name=uid`,
and a pod's template never changes under one UID, so the record is per pod instance. Pods keep serving
while their UID lives, so a proven revision's pods serve during an in-place rollout until replaced; a
replaced or new pod waits for a pass. A failed run holds the pods it blames (`outOfTraffic`, by name,
until a pass); an inconclusive one changes nothing. With the canary disabled every pod serves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from mooncake_operator import render
from mooncake_operator.api import (
    CanaryStatus,
    CanaryTarget,
    HighAvailabilityStatus,
    MooncakeServing,
    MooncakeServingSpec,
    MooncakeServingStatus,
    PodTraffic,
    ReplicaCounts,
    TrafficStatus,
)
from mooncake_operator.conditions import READY, merge_conditions
from mooncake_operator.metrics import ReconcileResult
from mooncake_operator.operator_settings import RERUN_CANARY_ANNOTATION
from mooncake_operator.reconcile import proof, status
from mooncake_operator.reconcile.observe import Observation, PodInfo
from mooncake_operator.reconcile.revisions import LastGood


@dataclass(frozen=True)
class Outcome:
    result: ReconcileResult
    message: str = ""
    # Set when the change handler should try again (kopf.TemporaryError); None: done until the next change.
    retry_after: float | None = None


@dataclass(frozen=True)
class RevisionChoice:
    """Which revision the children are rendered from."""

    revisions: status.Revisions
    spec: MooncakeServingSpec


@dataclass(frozen=True)
class CanaryRun:
    """A run that just finished: its evidence, and the pods a failure blames."""

    canary: CanaryStatus
    blamed: tuple[str, ...] = ()


@dataclass(frozen=True)
class CanaryOrder:
    """Run the canary against `target` (the replicas as observed now)."""

    target: CanaryTarget
    why: str


@dataclass(frozen=True)
class Timing:
    retry_delay_seconds: float
    inconclusive_retry_seconds: float


@dataclass(frozen=True)
class Inputs:
    resource: MooncakeServing
    current: MooncakeServingStatus  # the stored status (what the last pass wrote)
    choice: RevisionChoice
    observation: Observation
    last_good: LastGood | None  # the NAME-last-good record as read
    now: datetime
    timing: Timing
    fresh: CanaryRun | None = None  # a run that finished in this pass
    high_availability: HighAvailabilityStatus | None = None  # the masters' leader, as tracked this pass
    last_good_refused: str | None = None  # why the stored last good record was not trusted


@dataclass(frozen=True)
class Plan:
    verdict: status.Verdict  # phase and conditions (events are posted on phase transitions)
    status: MooncakeServingStatus  # the whole next status
    traffic_labels: dict[str, str]  # pod name -> traffic label value, only pods whose label must change
    outcome: Outcome | None  # None exactly when a canary is ordered
    run_canary: CanaryOrder | None = None  # write the status, set labels, run it, then plan again
    record_last_good: MooncakeServingSpec | None = None  # store it as NAME-last-good before the status
    # The spec's revision failed: the status records it as failed, and the next pass renders the last good.
    roll_back: bool = False


# --- which revision to render ---------------------------------------------------------------------------


def rerun_value(resource: MooncakeServing) -> str | None:
    return resource.metadata.annotations.get(RERUN_CANARY_ANNOTATION)


def rerun_requested(resource: MooncakeServing, last: CanaryStatus | None) -> bool:
    """The rerun-canary annotation holds a value no run has been run against yet."""
    rerun = rerun_value(resource)
    return rerun is not None and (last is None or last.target is None or last.target.rerun != rerun)


def choose_revision(
    resource: MooncakeServing, current: MooncakeServingStatus, last_good: LastGood | None
) -> RevisionChoice:
    """The spec's revision, or the last good one while the spec's revision stands rolled back."""
    spec = resource.spec
    desired = render.spec_hash(spec)
    failed = current.failed_revision
    if failed is not None and (
        failed != desired or rerun_requested(resource, current.canary) or spec.canary.on_failure != "Rollback"
    ):
        failed = None  # a new spec, a retry, or Rollback turned off: roll the spec out
    if failed is not None and last_good is not None and last_good.revision != desired:
        revisions = status.Revisions(desired, last_good.revision, failed, current.last_good_revision)
        return RevisionChoice(revisions, last_good.spec)
    return RevisionChoice(status.Revisions(desired, desired, None, current.last_good_revision), spec)


# --- traffic ------------------------------------------------------------------------------------------


def previous_traffic(current: MooncakeServingStatus) -> dict[str, PodTraffic]:
    """The last recorded traffic by pod UID. A status written before traffic was recorded: the pods the
    last passing run covered serve (what the labels said then), except the held ones."""
    if current.traffic is not None:
        return {entry.uid: entry for entry in current.traffic.pods}
    canary = current.canary
    if canary is None or canary.verdict != "Passed" or canary.target is None:
        return {}
    entries = {}
    for identity in canary.target.replica_pods:
        name, _, uid = identity.partition("=")
        if name not in current.out_of_traffic:
            reason = f"proven by canary run {canary.run_id}"
            entries[uid] = PodTraffic(
                name=name, uid=uid, serving=True, reason=reason, proven_by=canary.run_id
            )
    return entries


def next_held(current: MooncakeServingStatus, fresh: CanaryRun | None, *, enabled: bool) -> list[str]:
    """Pods held out of traffic by name: a failed run adds the pods it blames, a pass releases all."""
    if not enabled:
        return []
    held = set(current.out_of_traffic)
    if fresh is not None and fresh.canary.verdict == "Passed":
        held = set()
    elif fresh is not None and fresh.canary.verdict == "Failed":
        held |= set(fresh.blamed)
    return sorted(held)


def pod_traffic(
    pod: PodInfo,
    previous: PodTraffic | None,
    fresh: CanaryRun | None,
    held: Sequence[str],
    *,
    enabled: bool,
) -> PodTraffic:
    """Whether one pod serves, and why."""

    def entry(serving: bool, reason: str, proven_by: str | None = None) -> PodTraffic:
        return PodTraffic(
            name=pod.name,
            uid=pod.uid,
            revision=pod.revision,
            serving=serving,
            reason=reason,
            proven_by=proven_by,
        )

    revision = pod.revision or "unknown"
    if not enabled:
        return entry(True, "canary disabled (spec.canary.enabled: false): serves once Ready")
    if pod.name in held:
        return entry(False, "held: a failed canary blamed this replica; back after a passing run")
    run = fresh.canary if fresh is not None else None
    if run is not None and run.target is not None and pod.identity in run.target.replica_pods:
        if run.verdict == "Passed":
            return entry(True, f"proven by canary run {run.run_id} at revision {revision}", run.run_id)
        if previous is not None and previous.serving:
            return previous.model_copy(update={"revision": pod.revision})
        return entry(False, f"not proven: canary run {run.run_id} at revision {revision} was {run.verdict}")
    if previous is not None:
        return previous.model_copy(update={"name": pod.name, "revision": pod.revision})
    return entry(False, f"new pod at revision {revision}: waits for a canary to prove it")


def next_traffic(
    current: MooncakeServingStatus,
    observation: Observation,
    fresh: CanaryRun | None,
    held: Sequence[str],
    *,
    enabled: bool,
) -> TrafficStatus:
    """Every live replica pod (terminating ones are leaving the Service anyway), by name."""
    previous = previous_traffic(current)
    pods = [
        pod_traffic(pod, previous.get(pod.uid), fresh, held, enabled=enabled)
        for pod in observation.replicas.pods
        if not pod.terminating
    ]
    return TrafficStatus(serving=sum(1 for pod in pods if pod.serving), pods=pods)


def label_changes(observation: Observation, traffic: TrafficStatus) -> dict[str, str]:
    """Pod name -> the label value it must get, for pods whose label differs."""
    labels = {pod.name: pod.traffic for pod in observation.replicas.pods}
    wanted = {
        entry.name: render.TRAFFIC_ON if entry.serving else render.TRAFFIC_OFF for entry in traffic.pods
    }
    return {name: value for name, value in wanted.items() if labels.get(name) != value}


# --- the plan -----------------------------------------------------------------------------------------


def canary_target(inputs: Inputs) -> CanaryTarget:
    serving = inputs.resource.model_copy(update={"spec": inputs.choice.spec})
    by_name = {pod.name: pod for pod in inputs.observation.replicas.pods}
    master = inputs.observation.master.pod
    return proof.current_target(
        revision=inputs.choice.revisions.serving,
        generation=inputs.resource.metadata.generation,
        replica_pods=[by_name[name].identity for name in render.replica_pod_names(serving)],
        master_pod=master.uid if master else None,
        master_restarts=master.restarts if master else 0,
        rerun=rerun_value(inputs.resource),
        master_leader=master.name if master and render.ha_enabled(serving) else None,
    )


def _passed_at(canary: CanaryStatus | None, revision: str) -> bool:
    return (
        canary is not None
        and canary.verdict == "Passed"
        and canary.target is not None
        and canary.target.revision == revision
    )


def _must_roll_back(inputs: Inputs, revisions: status.Revisions, canary: CanaryStatus | None) -> bool:
    """The spec's own revision failed, Rollback is asked for, and a different good revision is stored."""
    failed_here = (
        canary is not None
        and canary.verdict == "Failed"
        and canary.target is not None
        and canary.target.revision == revisions.desired
    )
    return (
        failed_here
        and inputs.resource.spec.canary.on_failure == "Rollback"
        and revisions.serving == revisions.desired
        and inputs.last_good is not None
        and inputs.last_good.revision != revisions.desired
    )


def _next_status(
    inputs: Inputs,
    verdict: status.Verdict,
    revisions: status.Revisions,
    canary: CanaryStatus | None,
    held: list[str],
    traffic: TrafficStatus,
) -> MooncakeServingStatus:
    generation = inputs.resource.metadata.generation
    replicas = inputs.observation.replicas
    return MooncakeServingStatus(
        phase=verdict.phase,
        observed_generation=generation,
        conditions=merge_conditions(
            inputs.current.conditions,
            verdict.conditions,
            now=proof.format_time(inputs.now),
            generation=generation,
        ),
        replicas=ReplicaCounts(desired=replicas.desired, ready=replicas.ready),
        canary=canary,
        last_good_revision=revisions.last_good,
        desired_revision=revisions.desired,
        serving_revision=revisions.serving,
        failed_revision=revisions.failed,
        out_of_traffic=held,
        traffic=traffic,
        high_availability=inputs.high_availability,
    )


def _settled_outcome(
    verdict: status.Verdict, canary: CanaryStatus | None, revisions: status.Revisions, timing: Timing
) -> Outcome:
    message = verdict.conditions[READY].message
    if verdict.phase == "Ready":
        return Outcome(ReconcileResult.READY, message)
    if revisions.rolled_back:
        return Outcome(ReconcileResult.ROLLED_BACK, message)
    if canary is not None and canary.verdict == "Inconclusive":
        return Outcome(ReconcileResult.CANARY_FAILED, message, retry_after=timing.inconclusive_retry_seconds)
    return Outcome(ReconcileResult.CANARY_FAILED, message)


def plan(inputs: Inputs) -> Plan:
    """What this pass does, from what was read and observed (and the run that just finished, if any)."""
    spec = inputs.resource.spec
    enabled = spec.canary.enabled
    revisions = inputs.choice.revisions
    observation = inputs.observation
    canary = inputs.fresh.canary if inputs.fresh is not None else inputs.current.canary
    held = next_held(inputs.current, inputs.fresh, enabled=enabled)
    traffic = next_traffic(inputs.current, observation, inputs.fresh, held, enabled=enabled)
    labels = label_changes(observation, traffic)

    def planned(
        verdict: status.Verdict,
        outcome: Outcome | None,
        *,
        run_canary: CanaryOrder | None = None,
        record_last_good: MooncakeServingSpec | None = None,
        roll_back: bool = False,
    ) -> Plan:
        next_status = _next_status(inputs, verdict, revisions, canary, held, traffic)
        return Plan(verdict, next_status, labels, outcome, run_canary, record_last_good, roll_back)

    if inputs.fresh is None and not observation.ready:
        verdict = status.not_ready(observation, revisions, canary, enabled=enabled)
        message = verdict.conditions[READY].message
        return planned(verdict, Outcome(ReconcileResult.WAITING, message, inputs.timing.retry_delay_seconds))
    if not enabled:
        verdict = status.settled(
            observation, revisions, canary, enabled=False, on_failure=spec.canary.on_failure
        )
        return planned(verdict, Outcome(ReconcileResult.READY, verdict.conditions[READY].message))
    if inputs.fresh is None:
        target = canary_target(inputs)
        why = proof.canary_due(
            canary,
            target,
            now=inputs.now,
            interval_seconds=spec.canary.interval_seconds,
            inconclusive_retry_seconds=inputs.timing.inconclusive_retry_seconds,
        )
        if why is not None:
            verdict = status.canary_running(observation, revisions, why)
            return planned(verdict, None, run_canary=CanaryOrder(target, why))
    if _must_roll_back(inputs, revisions, canary):
        assert canary is not None  # checked by _must_roll_back
        verdict = status.rolling_back(observation, revisions, canary)
        revisions = dataclasses.replace(revisions, failed=revisions.desired)
        outcome = Outcome(
            ReconcileResult.ROLLED_BACK,
            verdict.conditions[READY].message,
            retry_after=min(inputs.timing.retry_delay_seconds, 1.0),
        )
        return planned(verdict, outcome, roll_back=True)
    failed_here = canary is not None and canary.verdict == "Failed"
    if failed_here and spec.canary.on_failure == "Rollback" and revisions.serving == revisions.desired:
        # A stored record that was changed after its canary is never rolled back to: say so.
        revisions = dataclasses.replace(revisions, rollback_refused=inputs.last_good_refused)
    record: MooncakeServingSpec | None = None
    if _passed_at(canary, revisions.serving):
        revisions = dataclasses.replace(revisions, last_good=revisions.serving)
        stored = inputs.last_good.revision if inputs.last_good is not None else None
        if not revisions.rolled_back and stored != revisions.serving:
            record = inputs.choice.spec
    verdict = status.settled(observation, revisions, canary, enabled=True, on_failure=spec.canary.on_failure)
    outcome = _settled_outcome(verdict, canary, revisions, inputs.timing)
    return planned(verdict, outcome, record_last_good=record)
