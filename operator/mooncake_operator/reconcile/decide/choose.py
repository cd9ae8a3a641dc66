"""What a pass renders, decided before anything is applied: the spec revision (the user's, or the last
good one after a failure with Rollback), its replica pod template, and the replica set it goes into.

Rollout strategies (`choose_sets`): InPlace renders the spec into the serving StatefulSet, which rolls.
BlueGreen does so too while the pod template is unchanged (or nothing serves users yet); a new template
is rendered into a candidate set of its own beside the serving one, which is left as it runs. The canary
proves the candidate's pods alone; on a pass the status names the candidate as serving, its pods go on
and the old set's off, then the old set is deleted. A failed or inconclusive candidate never serves:
Hold keeps it for inspection, Rollback deletes it (and renders the last good spec, the serving set's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_operator.api.group import RERUN_CANARY_ANNOTATION
from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.api.spec import MooncakeServingSpec, RolloutStrategy
from mooncake_operator.api.status import CanaryStatus, MooncakeServingStatus
from mooncake_operator.build.digests import spec_hash
from mooncake_operator.build.names import replica_pod_names, replica_set_name
from mooncake_operator.build.replicas import ReplicaTemplate
from mooncake_operator.reconcile.decide import status
from mooncake_operator.reconcile.decide.observe import LiveSet, PodInfo, RolloutView, in_set
from mooncake_operator.reconcile.decide.revisions import LastGood, verified_last_good
from mooncake_operator.reconcile.decide.rollout import (
    InPlaceSettings,
    InPlaceStep,
    LiveShape,
    SlotPod,
    plan_in_place,
)
from mooncake_operator.reconcile.decide.traffic import previous_traffic, unproven_if_restarted


@dataclass(frozen=True)
class SpecRevisionChoice:
    """Which revision the children are rendered from."""

    revisions: status.SpecRevisions
    spec: MooncakeServingSpec


@dataclass(frozen=True)
class SetChoice:
    """The replica set the spec is rendered into (`active`) and, only while `active` is a BlueGreen
    candidate, the set that serves users meanwhile (`serving`: not rendered, left as it runs)."""

    strategy: RolloutStrategy
    active: str
    serving: str | None = None
    remove: tuple[str, ...] = ()  # other sets of the resource: deleted after the status and labels

    @property
    def candidate(self) -> str | None:
        return self.active if self.serving is not None else None


@dataclass(frozen=True)
class Rendering:
    """What the children are rendered from (decided by `choose` before anything is applied): the
    verified last good record, the chosen revision, the resource with its spec (`serving`), the replica
    pod template it renders (rendered once per pass) and the set it goes into."""

    choice: SpecRevisionChoice
    serving: MooncakeServing
    template: ReplicaTemplate
    sets: SetChoice
    last_good: LastGood | None = None  # the NAME-last-good record, when trusted
    last_good_refused: str | None = None  # why the stored last good record was not trusted
    step: InPlaceStep | None = None  # the active set's replicas and partition (None: the spec's, 0)

    def canary_pods(self) -> list[str]:
        """The active set's pods the canary proves: every ordinal, or during an InPlace rollout the
        new pod template's (`InPlaceStep.new_ordinals`)."""
        if self.step is None or not self.step.rolling:
            return replica_pod_names(self.serving, self.sets.active)
        return [f"{self.sets.active}-{ordinal}" for ordinal in self.step.new_ordinals]

    def rollout_view(self) -> RolloutView | None:
        """What readiness needs of an InPlace rollout (None: none in progress)."""
        step = self.step
        if step is None or not step.rolling:
            return None
        new = tuple(self.canary_pods())
        kept = tuple(f"{self.sets.active}-{ordinal}" for ordinal in range(step.partition))
        waiting = ""
        if step.message.startswith("rollout paused"):
            waiting = step.message
        elif len(new) < 2 and self.serving.spec.canary.enabled:
            waiting = "the first replica of the new pod template waits for a second to pair with"
        return RolloutView(new, kept, waiting)


def rerun_value(resource: MooncakeServing) -> str | None:
    return resource.metadata.annotations.get(RERUN_CANARY_ANNOTATION)


def rerun_requested(resource: MooncakeServing, last: CanaryStatus | None) -> bool:
    """The rerun-canary annotation holds a value no run has been run against yet."""
    rerun = rerun_value(resource)
    return rerun is not None and (last is None or last.target is None or last.target.rerun != rerun)


def choose_spec_revision(
    resource: MooncakeServing, current: MooncakeServingStatus, last_good: LastGood | None
) -> SpecRevisionChoice:
    """The spec's revision, or the last good one while the spec's revision stands rolled back."""
    spec = resource.spec
    desired = spec_hash(spec)
    failed = current.failed_revision
    if failed is not None and (
        failed != desired or rerun_requested(resource, current.canary) or spec.canary.on_failure != "Rollback"
    ):
        failed = None  # a new spec, a retry, or Rollback turned off: roll the spec out
    if failed is not None and last_good is not None and last_good.spec_revision != desired:
        revisions = status.SpecRevisions(desired, last_good.spec_revision, failed, current.last_good_revision)
        return SpecRevisionChoice(revisions, last_good.spec)
    return SpecRevisionChoice(status.SpecRevisions(desired, desired, None, current.last_good_revision), spec)


def _serves_users(current: MooncakeServingStatus, replica_set: str) -> bool:
    return any(
        entry.serving and in_set(entry.name, replica_set) for entry in previous_traffic(current).values()
    )


def choose_sets(
    resource: MooncakeServing, current: MooncakeServingStatus, live: Sequence[LiveSet], template: str
) -> SetChoice:
    """Which replica set the chosen spec (whose pod template digest is `template`) is rendered into.

    The serving set is the one the status names, else NAME-replica, else the only set. InPlace, or a
    serving set with the same template (or none recorded: applied before sets carried one), or one
    whose pods serve no users yet: render into it (it rolls). Otherwise (BlueGreen) into the candidate
    NAME-r<template>, beside the serving set. Any other set of the resource is removed: a candidate of a
    template the spec no longer renders (a reverted or changed spec), or one left by a strategy change.
    """
    strategy = resource.spec.rollout_strategy
    default = replica_set_name(resource)
    by_name = {found.name: found for found in live}
    recorded = current.rollout.serving_set if current.rollout is not None else None
    if recorded is not None and recorded in by_name:
        serving = recorded
    elif default in by_name or not by_name:
        serving = default
    elif len(by_name) == 1:
        serving = next(iter(by_name))
    else:  # several sets and none known to serve: touch none of them
        return SetChoice(strategy, default)

    def others(*kept: str) -> tuple[str, ...]:
        return tuple(name for name in sorted(by_name) if name not in kept)

    found = by_name.get(serving)
    in_place = (
        strategy == "InPlace"
        or found is None
        or found.template in (None, template)
        or not _serves_users(current, serving)
    )
    if in_place:
        return SetChoice(strategy, serving, remove=others(serving))
    candidate = replica_set_name(resource, template)
    return SetChoice(strategy, candidate, serving, remove=others(serving, candidate))


def _ordinal(pod: PodInfo, replica_set: str) -> int | None:
    return int(pod.name.rsplit("-", 1)[1]) if in_set(pod.name, replica_set) else None


def in_place_step(
    resource: MooncakeServing,
    replicas: int,
    current: MooncakeServingStatus,
    sets: SetChoice,
    live: Sequence[LiveSet],
    template: str,
) -> InPlaceStep:
    """The active set's replicas and partition: `rollout.plan_in_place` for the set the spec rolls in
    place; a BlueGreen candidate starts whole (none of its pods while paused). The rollout settings are
    the user's spec's (also while a rolled-back revision is rendered); `replicas` the rendered one's."""
    spec = resource.spec
    rollout = spec.rollout_settings
    found = next((item for item in live if item.name == sets.active), None)
    if sets.candidate is not None:
        if rollout.paused:
            held = found.replicas if found is not None else 0
            message = (
                f"rollout paused (spec.rollout.paused): candidate {sets.candidate} holds {held} pod(s); "
                "set spec.rollout.paused to false to go on"
            )
            return InPlaceStep(replicas=held, partition=0, rolling=True, message=message)
        return InPlaceStep(replicas=replicas, partition=0)
    settings = InPlaceSettings(
        replicas=replicas,
        max_unavailable=rollout.max_unavailable,
        max_surge=rollout.max_surge,
        paused=rollout.paused,
        canary=spec.canary.enabled,
    )
    if found is None:
        return plan_in_place(settings, None, ())
    # A pod runs the rendered template when its set carries it and the pod has the set's update hash.
    current_template = found.template == template and found.observed and found.update_revision is not None
    previous = previous_traffic(current)
    pods = []
    for pod in found.pods:
        ordinal = _ordinal(pod, found.name)
        if ordinal is None:
            continue
        entry = unproven_if_restarted(pod, previous.get(pod.uid))
        pods.append(
            SlotPod(
                ordinal=ordinal,
                name=pod.name,
                current=current_template and pod.template_hash == found.update_revision,
                serving=entry is not None and entry.serving,
                terminating=pod.terminating,
            )
        )
    shape = LiveShape(
        found.replicas, found.partition, observed=found.observed, carries_template=found.template == template
    )
    return plan_in_place(settings, shape, pods)


def rendering(
    resource: MooncakeServing,
    current: MooncakeServingStatus,
    last_good: LastGood | None,
    live: Sequence[LiveSet],
    *,
    last_good_refused: str | None = None,
) -> Rendering:
    """The revision to render, its replica pod template (rendered here, once) and the set it goes into."""
    choice = choose_spec_revision(resource, current, last_good)
    serving = resource.model_copy(update={"spec": choice.spec})
    template = ReplicaTemplate.of(serving)
    sets = choose_sets(resource, current, live, template.id)
    step = in_place_step(resource, choice.spec.replicas, current, sets, live, template.id)
    return Rendering(choice, serving, template, sets, last_good, last_good_refused, step)


def choose(
    resource: MooncakeServing,
    current: MooncakeServingStatus,
    last_good_record: dict[str, Any] | None,
    live: Sequence[LiveSet],
) -> Rendering:
    """What to render, from what the pass read: the NAME-last-good ConfigMap is trusted only when it holds
    the revision the status recorded (`revisions.verified_last_good`)."""
    last_good, refused = verified_last_good(last_good_record, current.last_good_revision)
    return rendering(resource, current, last_good, live, last_good_refused=refused)
