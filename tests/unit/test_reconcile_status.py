"""Phase and conditions from what was observed, and the merge patch that writes only differences."""

from __future__ import annotations

import pytest

from mooncake_operator.api.status import CanaryStatus, CanaryTarget
from mooncake_operator.reconcile.decide import status
from mooncake_operator.reconcile.decide.conditions import READY
from mooncake_operator.reconcile.decide.observe import MasterState, Observation, PodInfo, ReplicaState
from mooncake_operator.reconcile.decide.status import SpecRevisions, merge_patch, without_empty_strings

pytestmark = pytest.mark.unit

POD = PodInfo("x-replica-0", "u0", True, False, "rev", 0, "on")
READY_OBSERVATION = Observation(
    MasterState(True, "master ready", POD), ReplicaState(2, 2, True, "2/2 replicas ready", (POD, POD))
)
DEPLOYING = Observation(
    MasterState(True, "master ready", POD), ReplicaState(2, 1, True, "1/2 replicas ready", (POD,))
)
NO_PODS = Observation(MasterState(False, "master pod not created yet"), ReplicaState(2, 0, False, "0/2"))
SPEC = SpecRevisions(desired="r2", serving="r2", failed=None, last_good="r1")


def run(verdict: str, revision: str = "r2") -> CanaryStatus:
    return CanaryStatus(
        run_id="run", verdict=verdict, reason="because", target=CanaryTarget(revision=revision)
    )


def test_merge_patch_writes_only_differences() -> None:
    old = {
        "phase": "Deploying",
        "replicas": {"desired": 2, "ready": 1},
        "failedRevision": "r9",
        "conditions": [1],
    }
    new = {"phase": "Deploying", "replicas": {"desired": 2, "ready": 2}, "conditions": [1]}
    assert merge_patch(old, new) == {"replicas": {"ready": 2}, "failedRevision": None}
    assert merge_patch(new, new) == {}
    assert merge_patch({"conditions": [1, 2]}, {"conditions": [2]}) == {"conditions": [2]}


def test_empty_strings_are_left_out() -> None:
    wire = {"a": "", "b": [{"reason": "", "verdict": "Passed"}], "c": {"d": ""}, "e": 0}
    assert without_empty_strings(wire) == {"b": [{"verdict": "Passed"}], "c": {}, "e": 0}


@pytest.mark.parametrize(
    ("observation", "revisions", "canary", "phase", "reason"),
    [
        (NO_PODS, SPEC, None, "Pending", "Pending"),
        (DEPLOYING, SPEC, None, "Deploying", "Deploying"),
        (DEPLOYING, SpecRevisions("r2", "r1", "r2", "r1"), run("Failed"), "Deploying", "RollingBack"),
        (DEPLOYING, SpecRevisions("r1", "r1", None, "r1"), run("Passed", "r1"), "Degraded", "ReplicasLost"),
    ],
)
def test_not_ready(
    observation: Observation, revisions: SpecRevisions, canary: CanaryStatus | None, phase: str, reason: str
) -> None:
    reported = status.not_ready(observation, revisions, canary, enabled=True)
    assert (reported.phase, reported.conditions[READY].reason, reported.conditions[READY].status) == (
        phase,
        reason,
        "False",
    )


@pytest.mark.parametrize(
    ("revisions", "canary", "enabled", "phase", "ready", "reason"),
    [
        (SPEC, run("Passed"), True, "Ready", "True", "Ready"),
        (SPEC, None, False, "Ready", "True", "Ready"),
        (SPEC, run("Failed"), True, "CanaryFailed", "False", "CanaryFailed"),
        (SPEC, run("Inconclusive"), True, "CanaryInconclusive", "False", "CanaryInconclusive"),
        (SPEC, run("Passed", "r1"), True, "Canary", "False", "CanaryPending"),  # not yet run for r2
        (SpecRevisions("r2", "r1", "r2", "r1"), run("Passed", "r1"), True, "Degraded", "False", "RolledBack"),
    ],
)
def test_settled(
    revisions: SpecRevisions, canary: CanaryStatus | None, enabled: bool, phase: str, ready: str, reason: str
) -> None:
    reported = status.settled(READY_OBSERVATION, revisions, canary, enabled=enabled, on_failure="Hold")
    condition = reported.conditions[READY]
    assert (reported.phase, condition.status, condition.reason) == (phase, ready, reason)


def test_hold_says_the_failed_replicas_are_out_of_traffic() -> None:
    held = status.settled(READY_OBSERVATION, SPEC, run("Failed"), enabled=True, on_failure="Hold")
    assert "out of the client Service" in held.conditions[READY].message
    rollback = status.settled(READY_OBSERVATION, SPEC, run("Failed"), enabled=True, on_failure="Rollback")
    assert "out of the client Service" not in rollback.conditions[READY].message


def test_warning_events_for_failures_and_rollbacks() -> None:
    assert status.event_type("CanaryFailed", "CanaryFailed") == "Warning"
    assert status.event_type("CanaryInconclusive", "CanaryInconclusive") == "Warning"
    assert status.event_type("Deploying", "RollingBack") == "Warning"
    assert status.event_type("Deploying", "Deploying") == "Normal"
    assert status.event_type("Ready", "Ready") == "Normal"
