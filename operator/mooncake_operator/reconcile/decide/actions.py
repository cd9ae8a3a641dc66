"""What one reconcile pass does, as values: `plan.decide` returns them, `act.core` carries them out in order.

A decision lists its actions in one fixed order: the master failover event, the last good record, the
status, the event of a phase transition, the traffic labels, the replica sets to delete, then the canary
run. So a status write that fails leaves every label and set as it was (a held replica is never put back
in traffic by a half-done pass), and an old set goes only once its successor's pods are in the client
Service. After a canary run, the pass decides again and carries out that decision's actions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from mooncake_operator.api.spec import MooncakeServingSpec
from mooncake_operator.api.status import CanaryTarget, MooncakeServingStatus


class ReconcileResult(StrEnum):
    """How a pass ended (the operator's reconciles_total counts them by this label)."""

    READY = "ready"
    WAITING = "waiting"
    CANARY_FAILED = "canary_failed"
    CANARY_INCONCLUSIVE = "canary_inconclusive"
    ROLLED_BACK = "rolled_back"
    INVALID = "invalid"
    GONE = "gone"
    ERROR = "error"


@dataclass(frozen=True)
class Outcome:
    result: ReconcileResult
    message: str = ""
    # Set when the worker should look again this soon; None: done until the next change.
    retry_after: float | None = None
    # The decision's timers, which no watch reports: seconds until the canary's interval falls due, and
    # until the next look at who leads highly available masters (asked over HTTP, not watched).
    canary_due_in: float | None = None
    leader_check_in: float | None = None

    def sleep_seconds(self, resync_seconds: float) -> float:
        """How long the worker may sleep without a poke: until its first timer, at most the resync."""
        timers = (self.retry_after, self.canary_due_in, self.leader_check_in)
        return max(min([resync_seconds, *(timer for timer in timers if timer is not None)]), 0.0)


@dataclass(frozen=True)
class PostEvent:
    """An Event on the resource (logged too)."""

    reason: str
    message: str
    type: str


@dataclass(frozen=True)
class RecordLastGood:
    """Store `spec` as the NAME-last-good ConfigMap (before the status names it)."""

    spec: MooncakeServingSpec


@dataclass(frozen=True)
class WriteStatus:
    """The whole next status; only what differs from the stored one is patched."""

    status: MooncakeServingStatus


@dataclass(frozen=True)
class SetTraffic:
    """Pod name -> traffic label value, only for pods whose label must change; each label is for the pod
    instance the decision observed (`uids`, pod name -> uid): a StatefulSet pod deleted and created
    again under its name since is another, unproven instance and must not get it."""

    labels: Mapping[str, str]
    uids: Mapping[str, str]


@dataclass(frozen=True)
class RemoveSets:
    """Replica StatefulSets to delete: an old set after a BlueGreen switch, a candidate the spec no
    longer asks for or that failed with Rollback."""

    names: tuple[str, ...]


@dataclass(frozen=True)
class RunCanary:
    """Run the canary against `target` (the replicas as observed), then decide again with its result."""

    target: CanaryTarget
    why: str


Action = PostEvent | RecordLastGood | WriteStatus | SetTraffic | RemoveSets | RunCanary


@dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...]
    outcome: Outcome | None  # None exactly when the decision ends with a canary run

    @property
    def status(self) -> MooncakeServingStatus:
        """The status this decision writes."""
        return next(action.status for action in self.actions if isinstance(action, WriteStatus))

    @property
    def canary(self) -> RunCanary | None:
        return next((action for action in self.actions if isinstance(action, RunCanary)), None)
