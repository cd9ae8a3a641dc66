"""Status conditions: reason constants and the one pure helper that writes the full list.

The operator writes status as a JSON merge patch, which replaces lists whole, so it always writes every
condition (MasterReady, ReplicasReady, CanaryPassed, Ready, in that order, then kstatus' Reconciling and
Stalled, derived from Ready so that Flux, `kubectl wait` and kstatus-based tools need no knowledge of
this resource). `lastTransitionTime` moves only when a condition's status flips, as Kubernetes
conventions ask.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from mooncake_operator.api.status import CONDITION_TYPES, KSTATUS_CONDITION_TYPES, Condition, ConditionType

MASTER_READY: ConditionType = "MasterReady"
REPLICAS_READY: ConditionType = "ReplicasReady"
CANARY_PASSED: ConditionType = "CanaryPassed"
READY: ConditionType = "Ready"
RECONCILING: ConditionType = "Reconciling"
STALLED: ConditionType = "Stalled"

ConditionStatus = Literal["True", "False", "Unknown"]


class Reason(StrEnum):
    # MasterReady
    MASTER_READY = "MasterReady"
    MASTER_NOT_READY = "MasterNotReady"
    # ReplicasReady
    REPLICAS_READY = "ReplicasReady"
    REPLICAS_NOT_READY = "ReplicasNotReady"
    # CanaryPassed
    CANARY_PASSED = "CanaryPassed"
    CANARY_FAILED = "CanaryFailed"
    CANARY_INCONCLUSIVE = "CanaryInconclusive"
    CANARY_RUNNING = "CanaryRunning"
    CANARY_PENDING = "CanaryPending"
    CANARY_DISABLED = "CanaryDisabled"
    # Ready (and the canary's reasons above)
    READY = "Ready"
    PENDING = "Pending"
    DEPLOYING = "Deploying"
    REPLICAS_LOST = "ReplicasLost"
    ROLLING_BACK = "RollingBack"
    ROLLED_BACK = "RolledBack"
    # Every condition of a resource that cannot be reconciled
    INVALID_SPEC = "InvalidSpec"
    APPLY_FAILED = "ApplyFailed"  # the API server refused a child; the message holds its words


@dataclass(frozen=True)
class ConditionState:
    """What a condition should say now; `merge_conditions` adds the times."""

    status: ConditionStatus
    reason: Reason
    message: str = ""


def true(reason: Reason, message: str = "") -> ConditionState:
    return ConditionState("True", reason, message)


def false(reason: Reason, message: str = "") -> ConditionState:
    return ConditionState("False", reason, message)


def unknown(reason: Reason, message: str = "") -> ConditionState:
    return ConditionState("Unknown", reason, message)


# Ready reasons after which the operator cannot make progress without a change from the user (a new
# spec, a rerun of the canary, or a fix of what refused a child): kstatus' Stalled.
STALLED_REASONS = frozenset(
    {Reason.INVALID_SPEC, Reason.CANARY_FAILED, Reason.ROLLED_BACK, Reason.APPLY_FAILED}
)


def kstatus_states(ready: ConditionState) -> dict[ConditionType, ConditionState]:
    """Reconciling and Stalled as kstatus reads them: at most one is True, none when Ready is."""
    if ready.status == "True":
        return {RECONCILING: false(ready.reason), STALLED: false(ready.reason)}
    if ready.reason in STALLED_REASONS:
        return {RECONCILING: false(ready.reason), STALLED: true(ready.reason, ready.message)}
    return {RECONCILING: true(ready.reason, ready.message), STALLED: false(ready.reason)}


def find(conditions: Sequence[Condition], type_: ConditionType) -> Condition | None:
    return next((condition for condition in conditions if condition.type == type_), None)


def merge_conditions(
    previous: Sequence[Condition],
    desired: Mapping[ConditionType, ConditionState],
    *,
    now: str,
    generation: int | None,
) -> list[Condition]:
    """The full list in the canonical order (Reconciling and Stalled derived from Ready). A condition
    keeps its `lastTransitionTime` unless its status differs from the previous one (or it had none)."""
    missing = [type_ for type_ in CONDITION_TYPES if type_ not in desired]
    if missing:
        raise ValueError(f"every condition must be given; missing: {', '.join(missing)}")
    states = {**desired, **kstatus_states(desired[READY])}
    merged = []
    for type_ in CONDITION_TYPES + KSTATUS_CONDITION_TYPES:
        state = states[type_]
        before = find(previous, type_)
        transition = before.last_transition_time if before and before.status == state.status else now
        merged.append(
            Condition(
                type=type_,
                status=state.status,
                reason=state.reason.value,
                message=state.message,
                last_transition_time=transition,
                observed_generation=generation,
            )
        )
    return merged
