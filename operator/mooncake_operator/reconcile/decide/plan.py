"""The reconcile's decision, as a pure function: what the status says, whether a canary runs, whether to
record the last good revision or roll back, which sets go, when to try again.

A pass reads the resource, its stored status, the last good record and the live replica sets; `choose`
decides what to render from them. `act.core` applies that, observes the children and asks the masters who
leads, and hands the whole `Snapshot` to `decide`, which returns the actions (`actions`) in the order
`act.core` carries them out: record the last good revision, write the status, then set the traffic
labels (a status write that fails leaves every label as it was, so it can never put a held replica back
in traffic). When the decision ends with a canary run, `act.core` runs it and calls `decide` again on the
same snapshot with the run's result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.api.spec import MooncakeServingSpec
from mooncake_operator.api.status import (
    MAX_FOREIGN_PODS,
    CanaryStatus,
    CanaryTarget,
    CandidatePhase,
    HighAvailabilityStatus,
    MooncakeServingStatus,
    ReplicaCounts,
    RolloutStatus,
    TrafficStatus,
)
from mooncake_operator.build.etcd import ha_enabled
from mooncake_operator.build.names import replica_selector_string
from mooncake_operator.canary.status import format_time
from mooncake_operator.reconcile.decide import status
from mooncake_operator.reconcile.decide.actions import (
    Action,
    Decision,
    Outcome,
    PostEvent,
    ReconcileResult,
    RecordLastGood,
    RemoveSets,
    RunCanary,
    SetTraffic,
    WriteStatus,
)
from mooncake_operator.reconcile.decide.canary_run import CanaryRun
from mooncake_operator.reconcile.decide.choose import Rendering, SetChoice, SpecRevisionChoice, rerun_value
from mooncake_operator.reconcile.decide.conditions import READY, find, merge_conditions
from mooncake_operator.reconcile.decide.leadership import MasterView, find_leader, track
from mooncake_operator.reconcile.decide.observe import Observation
from mooncake_operator.reconcile.decide.revisions import LastGood
from mooncake_operator.reconcile.decide.rollout import InPlaceStep
from mooncake_operator.reconcile.decide.schedule import canary_due, current_target, interval_due_in
from mooncake_operator.reconcile.decide.traffic import label_changes, next_held, next_traffic


@dataclass(frozen=True)
class Timing:
    retry_delay_seconds: float
    inconclusive_retry_seconds: float
    leader_check_seconds: float  # highly available masters: how often to ask who leads


@dataclass(frozen=True)
class Snapshot:
    """Everything one pass decides from, read once: the resource, its stored status, what is rendered,
    the children as observed after the apply (the masters' state before asking who leads), and the
    highly available masters' own answers (None: a single master, no leader to find)."""

    resource: MooncakeServing
    status: MooncakeServingStatus  # the stored status (what the last pass wrote)
    rendering: Rendering
    observation: Observation
    now: datetime
    timing: Timing
    master_views: tuple[MasterView | None, ...] | None = None  # by master ordinal


@dataclass(frozen=True)
class _Inputs:
    resource: MooncakeServing
    current: MooncakeServingStatus  # the status before this decision (stored, or written before the run)
    choice: SpecRevisionChoice
    observation: Observation  # its master state decided by the leader, with highly available masters
    last_good: LastGood | None
    now: datetime
    timing: Timing
    sets: SetChoice
    fresh: CanaryRun | None = None  # a run that finished in this pass
    high_availability: HighAvailabilityStatus | None = None  # the masters' leader, as tracked this pass
    last_good_refused: str | None = None
    canary_pods: tuple[str, ...] = ()  # the active set's pods the canary proves (Rendering.canary_pods)
    step: InPlaceStep | None = None  # the InPlace rollout's step (Rendering.step)


@dataclass(frozen=True)
class _Plan:
    reported: status.PhaseAndConditions  # events are posted on phase transitions
    status: MooncakeServingStatus  # the whole next status
    traffic_labels: dict[str, str]  # pod name -> traffic label value, only pods whose label must change
    outcome: Outcome | None  # None exactly when a canary is ordered
    run_canary: RunCanary | None = None
    record_last_good: MooncakeServingSpec | None = None
    remove_sets: tuple[str, ...] = ()
    pod_uids: dict[str, str] = dataclasses.field(default_factory=dict)  # pod name -> the instance observed


def canary_target(inputs: _Inputs) -> CanaryTarget:
    serving = inputs.resource.model_copy(update={"spec": inputs.choice.spec})
    by_name = {pod.name: pod for pod in inputs.observation.replicas.pods}
    names = inputs.canary_pods
    master = inputs.observation.master.pod
    return current_target(
        revision=inputs.choice.revisions.serving,
        generation=inputs.resource.metadata.generation,
        replica_pods=[by_name[name].identity for name in names],
        master_pod=master.uid if master else None,
        master_restarts=master.restarts if master else 0,
        rerun=rerun_value(inputs.resource),
        master_leader=master.name if master and ha_enabled(serving) else None,
    )


def canary_urls(observation: Observation, pod_names: Sequence[str], port: int) -> list[str] | str:
    """The canary's URL of each of `pod_names` (ordinal order): the IP of the pod the observation found
    (a pod this resource's StatefulSet created), never a DNS name another pod with the same
    hostname/subdomain could answer for. Or why there are none to use: a pod missing, or without an IP."""
    by_name = {pod.name: pod for pod in observation.replicas.pods if not pod.terminating}
    urls, missing = [], []
    for name in pod_names:
        pod = by_name.get(name)
        if pod is None or not pod.ip:
            missing.append(name)
        else:
            host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
            urls.append(f"http://{host}:{port}")
    if missing:
        return (
            f"no pod IP yet for replica pod(s) {', '.join(missing)} created by this resource's StatefulSet: "
            "the canary reaches each replica at the IP of the pod it proves; retried"
        )
    shared = sorted({url for url in urls if urls.count(url) > 1})
    if shared:
        return f"replica pods share an address ({', '.join(shared)}): the canary needs one per replica"
    return urls


def _passed_at(canary: CanaryStatus | None, revision: str) -> bool:
    return (
        canary is not None
        and canary.verdict == "Passed"
        and canary.target is not None
        and canary.target.revision == revision
    )


def _must_roll_back(inputs: _Inputs, revisions: status.SpecRevisions, canary: CanaryStatus | None) -> bool:
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
        and inputs.last_good.spec_revision != revisions.desired
    )


def _next_status(
    inputs: _Inputs,
    reported: status.PhaseAndConditions,
    revisions: status.SpecRevisions,
    canary: CanaryStatus | None,
    held: list[str],
    traffic: TrafficStatus,
    rollout: RolloutStatus,
) -> MooncakeServingStatus:
    generation = inputs.resource.metadata.generation
    replicas = inputs.observation.replicas
    return MooncakeServingStatus(
        phase=reported.phase,
        observed_generation=generation,
        conditions=merge_conditions(
            inputs.current.conditions,
            reported.conditions,
            now=format_time(inputs.now),
            generation=generation,
        ),
        replicas=ReplicaCounts(desired=replicas.desired, ready=replicas.ready),
        selector=replica_selector_string(inputs.resource),
        canary=canary,
        last_good_revision=revisions.last_good,
        desired_revision=revisions.desired,
        serving_revision=revisions.serving,
        failed_revision=revisions.failed,
        out_of_traffic=held,
        traffic=traffic,
        high_availability=inputs.high_availability,
        rollout=rollout,
        foreign_pods=list(inputs.observation.foreign) or None,
    )


def _covers(canary: CanaryStatus | None, revision: str, observation: Observation) -> bool:
    """The run was at `revision` and against exactly the active set's pods as they are now."""
    pods = {pod.identity for pod in observation.replicas.pods if not pod.terminating}
    return (
        canary is not None
        and canary.target is not None
        and canary.target.revision == revision
        and set(canary.target.replica_pods) == pods
    )


def rollout_status(
    sets: SetChoice,
    phase: CandidatePhase | None,
    canary: CanaryStatus | None,
    *,
    switched: bool = False,
    removed_candidate: bool = False,
    step: InPlaceStep | None = None,
) -> RolloutStatus:
    """The serving set and, during a BlueGreen rollout, the candidate and its phase; during an InPlace
    rollout (or a paused one), what it does or waits for (`step`)."""
    candidate = sets.candidate
    step_message = step.message if step is not None else ""
    if candidate is None or sets.serving is None:
        return RolloutStatus(strategy=sets.strategy, serving_set=sets.active, message=step_message)
    run = canary.run_id if canary is not None else "?"
    if switched:
        message = (
            f"switched from {sets.serving} to {candidate} after canary run {run}; {sets.serving} removed"
        )
        return RolloutStatus(strategy=sets.strategy, serving_set=candidate, message=message)
    if removed_candidate:
        message = (
            f"candidate {candidate} failed canary run {run} and is removed (onFailure Rollback); "
            f"{sets.serving} keeps serving"
        )
        return RolloutStatus(strategy=sets.strategy, serving_set=sets.serving, message=message)
    messages: dict[CandidatePhase, str] = {
        "Deploying": f"candidate {candidate} is starting; {sets.serving} serves",
        "Canary": f"candidate {candidate} is being proven by the canary; {sets.serving} serves",
        "Inconclusive": (
            f"candidate {candidate}: canary run {run} was Inconclusive, retried; never switched to "
            f"before a pass; {sets.serving} serves"
        ),
        "Held": (
            f"candidate {candidate} failed canary run {run}; kept for inspection (onFailure Hold), never "
            f"switched to; {sets.serving} serves"
        ),
    }
    shown = phase or "Canary"
    return RolloutStatus(
        strategy=sets.strategy,
        serving_set=sets.serving,
        candidate_set=candidate,
        candidate_phase=shown,
        message=step_message or messages[shown],
    )


def _candidate_phase(canary: CanaryStatus | None, revision: str, observation: Observation) -> CandidatePhase:
    if not _covers(canary, revision, observation):
        return "Canary"
    assert canary is not None  # checked by _covers
    if canary.verdict == "Failed":
        return "Held"
    if canary.verdict == "Passed":
        return "Canary"
    return "Inconclusive"


def _settled_outcome(
    reported: status.PhaseAndConditions,
    canary: CanaryStatus | None,
    revisions: status.SpecRevisions,
    timing: Timing,
) -> Outcome:
    message = reported.conditions[READY].message
    if reported.phase == "Ready":
        return Outcome(ReconcileResult.READY, message)
    if revisions.rolled_back:
        return Outcome(ReconcileResult.ROLLED_BACK, message)
    if canary is not None and canary.verdict == "Inconclusive":
        return Outcome(
            ReconcileResult.CANARY_INCONCLUSIVE, message, retry_after=timing.inconclusive_retry_seconds
        )
    return Outcome(ReconcileResult.CANARY_FAILED, message)


def _plan(inputs: _Inputs) -> _Plan:
    """What this pass does, from what was read and observed (and the run that just finished, if any)."""
    spec = inputs.resource.spec
    enabled = spec.canary.enabled
    revisions = inputs.choice.revisions
    observation = inputs.observation
    sets = inputs.sets
    canary = inputs.fresh.canary if inputs.fresh is not None else inputs.current.canary
    held = next_held(inputs.current, inputs.fresh, enabled=enabled)

    def planned(
        reported: status.PhaseAndConditions,
        outcome: Outcome | None,
        *,
        run_canary: RunCanary | None = None,
        record_last_good: MooncakeServingSpec | None = None,
        roll_back: bool = False,
        phase: CandidatePhase | None = None,
        switched: bool = False,
    ) -> _Plan:
        traffic = next_traffic(
            inputs.current,
            observation,
            inputs.fresh,
            held,
            enabled=enabled,
            candidate=sets.candidate,
            serving_set=sets.serving,
            switched=switched,
            retire=inputs.step.retire if inputs.step is not None else (),
        )
        rollout = rollout_status(
            sets, phase, canary, switched=switched, removed_candidate=roll_back, step=inputs.step
        )
        if inputs.step is not None and inputs.step.rolling and reported.phase == "Ready":
            reported = status.still_rolling(reported, inputs.step.message)
        removed = sets.remove
        if sets.serving is not None and switched:
            removed += (sets.serving,)
        if sets.candidate is not None and roll_back:
            removed += (sets.candidate,)
        next_status = _next_status(inputs, reported, revisions, canary, held, traffic, rollout)
        labels = label_changes(observation, traffic)
        uids = {
            pod.name: pod.uid
            for pod in (*observation.replicas.pods, *observation.others)
            if pod.name in labels
        }
        return _Plan(
            reported,
            next_status,
            labels,
            outcome,
            run_canary,
            record_last_good,
            tuple(removed),
            pod_uids=uids,
        )

    if inputs.fresh is None and not observation.ready:
        reported = status.not_ready(observation, revisions, canary, enabled=enabled)
        message = reported.conditions[READY].message
        outcome = Outcome(ReconcileResult.WAITING, message, inputs.timing.retry_delay_seconds)
        return planned(reported, outcome, phase="Deploying")
    if not enabled:
        reported = status.settled(
            observation, revisions, canary, enabled=False, on_failure=spec.canary.on_failure
        )
        # BlueGreen without a canary: the candidate is switched to once all its replicas are Ready.
        outcome = Outcome(ReconcileResult.READY, reported.conditions[READY].message)
        return planned(reported, outcome, switched=sets.candidate is not None)
    if inputs.fresh is None:
        target = canary_target(inputs)
        why = canary_due(
            canary,
            target,
            now=inputs.now,
            interval_seconds=spec.canary.interval_seconds,
            inconclusive_retry_seconds=inputs.timing.inconclusive_retry_seconds,
        )
        if why is not None:
            reported = status.canary_running(observation, revisions, why)
            return planned(reported, None, run_canary=RunCanary(target, why), phase="Canary")
    if _must_roll_back(inputs, revisions, canary):
        assert canary is not None  # checked by _must_roll_back
        reported = status.rolling_back(observation, revisions, canary)
        revisions = dataclasses.replace(revisions, failed=revisions.desired)
        outcome = Outcome(
            ReconcileResult.ROLLED_BACK,
            reported.conditions[READY].message,
            retry_after=min(inputs.timing.retry_delay_seconds, 1.0),
        )
        return planned(reported, outcome, roll_back=True)
    failed_here = canary is not None and canary.verdict == "Failed"
    if failed_here and spec.canary.on_failure == "Rollback" and revisions.serving == revisions.desired:
        # A stored record that was changed after its canary is never rolled back to: say so.
        revisions = dataclasses.replace(revisions, rollback_refused=inputs.last_good_refused)
    record: MooncakeServingSpec | None = None
    if _passed_at(canary, revisions.serving):
        revisions = dataclasses.replace(revisions, last_good=revisions.serving)
        stored = inputs.last_good.spec_revision if inputs.last_good is not None else None
        if not revisions.rolled_back and stored != revisions.serving:
            record = inputs.choice.spec
    # A BlueGreen candidate is switched to only after a pass over exactly its pods as they are now.
    switched = (
        sets.candidate is not None
        and _passed_at(canary, revisions.serving)
        and _covers(canary, revisions.serving, observation)
    )
    phase = None if switched else _candidate_phase(canary, revisions.serving, observation)
    reported = status.settled(observation, revisions, canary, enabled=True, on_failure=spec.canary.on_failure)
    outcome = _settled_outcome(reported, canary, revisions, inputs.timing)
    return planned(reported, outcome, record_last_good=record, phase=phase, switched=switched)


def _leadership(
    snapshot: Snapshot,
) -> tuple[Observation, HighAvailabilityStatus | None, PostEvent | None]:
    """With highly available masters: the observation with the leader the masters name, the status's
    leader record, and the failover event when the leader changed."""
    if snapshot.master_views is None:
        return snapshot.observation, None, None
    found = find_leader(snapshot.rendering.serving, snapshot.observation, snapshot.master_views)
    tracked, failover = track(snapshot.status.high_availability, found, now=format_time(snapshot.now))
    event = None if failover is None else PostEvent(reason="MasterFailover", message=failover, type="Warning")
    return found.observation, tracked, event


def decide(snapshot: Snapshot, fresh: CanaryRun | None = None, *, now: datetime | None = None) -> Decision:
    """What this pass does, from its snapshot; with `fresh` (the canary run the first decision ordered,
    finished at `now`), what it does after the run, against the status the first decision wrote."""
    observation, high_availability, failover = _leadership(snapshot)
    rendered = snapshot.rendering
    inputs = _Inputs(
        resource=snapshot.resource,
        current=snapshot.status,
        choice=rendered.choice,
        observation=observation,
        last_good=rendered.last_good,
        now=snapshot.now,
        timing=snapshot.timing,
        sets=rendered.sets,
        high_availability=high_availability,
        last_good_refused=rendered.last_good_refused,
        canary_pods=tuple(rendered.canary_pods()),
        step=rendered.step,
    )
    first = _plan(inputs)
    if fresh is None:
        decision = _decision(snapshot.status, first, () if failover is None else (failover,))
        return with_timers(decision, snapshot.resource, snapshot.now, snapshot.timing)
    moment = now or snapshot.now
    after = _plan(dataclasses.replace(inputs, current=first.status, now=moment, fresh=fresh))
    decision = _decision(first.status, after, fresh.events)  # the run's own events first
    return with_timers(decision, snapshot.resource, moment, snapshot.timing)


def with_timers(decision: Decision, resource: MooncakeServing, now: datetime, timing: Timing) -> Decision:
    """The decision with its outcome's timers set, from the spec and the status it writes: when the
    canary's interval falls due, and when to ask highly available masters again who leads."""
    if decision.outcome is None:
        return decision
    outcome = dataclasses.replace(
        decision.outcome,
        canary_due_in=interval_due_in(resource.spec.canary, decision.status.canary, now),
        leader_check_in=timing.leader_check_seconds if ha_enabled(resource) else None,
    )
    return dataclasses.replace(decision, outcome=outcome)


def _decision(previous: MooncakeServingStatus, planned: _Plan, first: tuple[Action, ...]) -> Decision:
    actions = list(first)
    if planned.record_last_good is not None:
        actions.append(RecordLastGood(planned.record_last_good))
    actions += _status_actions(previous, planned.reported, planned.status)
    if planned.traffic_labels:
        actions.append(SetTraffic(planned.traffic_labels, planned.pod_uids))
    if planned.remove_sets:
        actions.append(RemoveSets(planned.remove_sets))
    if planned.run_canary is not None:
        actions.append(planned.run_canary)
    return Decision(tuple(actions), planned.outcome)


def foreign_pod_event(previous: MooncakeServingStatus, new: MooncakeServingStatus) -> PostEvent | None:
    """A Warning when the client Service selects a pod no replica StatefulSet of this resource created,
    posted when such a pod is first seen (not on every pass while it stays)."""
    found = new.foreign_pods or []
    if not set(found) - set(previous.foreign_pods or []):
        return None
    more = f" (the first {len(found)} found)" if len(found) >= MAX_FOREIGN_PODS else ""
    message = (
        f"the client Service selects pod(s) {', '.join(found)}{more} that no replica StatefulSet of this "
        "resource created: they carry every label of its selector and get user traffic no canary proved; "
        "delete them or remove the labels (the operator does not touch pods it does not own)"
    )
    return PostEvent(reason="ForeignPodInService", message=message, type="Warning")


def _ready_message(current: MooncakeServingStatus) -> str | None:
    ready = find(current.conditions, READY)
    return ready.message if ready else None


def _status_actions(
    previous: MooncakeServingStatus, reported: status.PhaseAndConditions, new: MooncakeServingStatus
) -> list[Action]:
    """Write `new` (built from `reported`); an event on every phase transition, and for an invalid spec
    on every change of what is wrong."""
    actions: list[Action] = [WriteStatus(new)]
    if reported.phase != previous.phase or (
        reported.phase == "Invalid" and _ready_message(previous) != _ready_message(new)
    ):
        ready = find(new.conditions, READY)
        reason = ready.reason if ready else reported.phase
        message = f"{reported.phase}: {ready.message}" if ready else reported.phase
        actions.append(PostEvent(reason, message, status.event_type(reported.phase, reason)))
    foreign = foreign_pod_event(previous, new)
    if foreign is not None:
        actions.append(foreign)
    return actions


def _not_reconciled(
    current: MooncakeServingStatus,
    reported: status.PhaseAndConditions,
    *,
    generation: int | None,
    now: datetime,
) -> list[Action]:
    """`reported` written over the stored status, every other field kept."""
    conditions = merge_conditions(
        current.conditions, reported.conditions, now=format_time(now), generation=generation
    )
    update = {"phase": reported.phase, "observed_generation": generation, "conditions": conditions}
    return _status_actions(current, reported, current.model_copy(update=update))


def invalid(
    current: MooncakeServingStatus, problems: list[str], *, generation: int | None, now: datetime
) -> Decision:
    """Nothing is applied; the status says why, field by field; no retry until the resource changes."""
    actions = _not_reconciled(current, status.invalid(problems), generation=generation, now=now)
    return Decision(tuple(actions), Outcome(ReconcileResult.INVALID, "; ".join(problems)))


def apply_failed(
    resource: MooncakeServing,
    current: MooncakeServingStatus,
    message: str,
    *,
    generation: int | None,
    now: datetime,
    timing: Timing,
) -> Decision:
    """The API server refused a child: Ready says why, retried soon."""
    reported = status.apply_failed(message, current.phase)
    actions = _not_reconciled(current, reported, generation=generation, now=now)
    decision = Decision(tuple(actions), Outcome(ReconcileResult.ERROR, message, timing.retry_delay_seconds))
    return with_timers(decision, resource, now, timing)
