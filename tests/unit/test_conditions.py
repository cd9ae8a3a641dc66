"""The conditions helper: the full list in order, transition times move only when a status flips."""

from __future__ import annotations

import pytest

from mooncake_operator.api.status import CONDITION_TYPES, KSTATUS_CONDITION_TYPES
from mooncake_operator.reconcile.decide import conditions as cond
from mooncake_operator.reconcile.decide.conditions import Reason, merge_conditions

pytestmark = pytest.mark.unit

ALL_TRUE = {
    cond.MASTER_READY: cond.true(Reason.MASTER_READY),
    cond.REPLICAS_READY: cond.true(Reason.REPLICAS_READY),
    cond.CANARY_PASSED: cond.true(Reason.CANARY_PASSED, "run 1"),
    cond.READY: cond.true(Reason.READY),
}


def test_every_condition_is_written_in_the_canonical_order() -> None:
    merged = merge_conditions([], ALL_TRUE, now="T1", generation=3)
    assert [c.type for c in merged] == [*CONDITION_TYPES, *KSTATUS_CONDITION_TYPES]
    assert all(c.last_transition_time == "T1" and c.observed_generation == 3 for c in merged)


def test_transition_time_moves_only_when_the_status_flips() -> None:
    first = merge_conditions([], ALL_TRUE, now="T1", generation=1)
    changed = {
        **ALL_TRUE,
        cond.CANARY_PASSED: cond.true(Reason.CANARY_PASSED, "run 2"),  # same status, new message
        cond.READY: cond.false(Reason.CANARY_FAILED, "warm != cold"),
    }
    second = merge_conditions(first, changed, now="T2", generation=2)
    times = {c.type: c.last_transition_time for c in second}
    assert times == {
        "MasterReady": "T1",
        "ReplicasReady": "T1",
        "CanaryPassed": "T1",
        "Ready": "T2",
        "Reconciling": "T1",  # False before and after
        "Stalled": "T2",  # a failed canary stalls the rollout
    }
    ready = cond.find(second, cond.READY)
    assert ready is not None and (ready.status, ready.reason, ready.message) == (
        "False",
        "CanaryFailed",
        "warm != cold",
    )
    assert all(c.observed_generation == 2 for c in second)


def test_a_missing_condition_is_a_programming_error() -> None:
    partial = {cond.READY: cond.true(Reason.READY)}
    with pytest.raises(ValueError, match="MasterReady, ReplicasReady, CanaryPassed"):
        merge_conditions([], partial, now="T", generation=None)


def test_every_reason_fits_the_api_pattern() -> None:
    for reason in Reason:
        merge_conditions([], {**ALL_TRUE, cond.READY: cond.false(reason)}, now="T", generation=None)


def _kstatus(ready: cond.ConditionState) -> tuple[str, str]:
    merged = merge_conditions([], {**ALL_TRUE, cond.READY: ready}, now="T", generation=4)
    reconciling, stalled = cond.find(merged, cond.RECONCILING), cond.find(merged, cond.STALLED)
    assert reconciling is not None and stalled is not None
    assert reconciling.observed_generation == stalled.observed_generation == 4
    if stalled.status == "True":
        assert (stalled.reason, stalled.message) == (ready.reason.value, ready.message)
    if reconciling.status == "True":
        assert (reconciling.reason, reconciling.message) == (ready.reason.value, ready.message)
    return reconciling.status, stalled.status


@pytest.mark.parametrize(
    ("ready", "expected"),
    [
        (cond.true(Reason.READY, "proven"), ("False", "False")),
        (cond.false(Reason.DEPLOYING, "rolling out"), ("True", "False")),
        (cond.false(Reason.PENDING, "waiting for pods"), ("True", "False")),
        (cond.false(Reason.CANARY_RUNNING, "run 3"), ("True", "False")),
        (cond.false(Reason.CANARY_INCONCLUSIVE, "retried"), ("True", "False")),
        (cond.false(Reason.REPLICAS_LOST, "1/2"), ("True", "False")),
        (cond.false(Reason.ROLLING_BACK, "to abc"), ("True", "False")),
        (cond.false(Reason.INVALID_SPEC, "spec.x: bad"), ("False", "True")),
        (cond.false(Reason.CANARY_FAILED, "warm != cold"), ("False", "True")),
        (cond.false(Reason.ROLLED_BACK, "serving abc"), ("False", "True")),
        (cond.false(Reason.APPLY_FAILED, "refused"), ("False", "True")),
    ],
)
def test_kstatus_reconciling_and_stalled_follow_ready(
    ready: cond.ConditionState, expected: tuple[str, str]
) -> None:
    assert _kstatus(ready) == expected
