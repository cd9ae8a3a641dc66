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
from mooncake_operator.build.names import replica_set_name
from mooncake_operator.build.replicas import ReplicaTemplate
from mooncake_operator.reconcile.decide import status
from mooncake_operator.reconcile.decide.observe import LiveSet, in_set
from mooncake_operator.reconcile.decide.revisions import LastGood, verified_last_good
from mooncake_operator.reconcile.decide.traffic import previous_traffic


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
    return Rendering(choice, serving, template, sets, last_good, last_good_refused)


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
