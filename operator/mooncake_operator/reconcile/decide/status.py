"""Phase and conditions from what was observed (pure), and the merge patch that writes only differences."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mooncake_operator.api.status import CanaryStatus, ConditionType, Phase
from mooncake_operator.reconcile.decide import conditions as cond
from mooncake_operator.reconcile.decide.conditions import ConditionState, Reason
from mooncake_operator.reconcile.decide.observe import Observation

# An inconclusive canary is a warning too (new pods stay out of traffic), though it needs no one to act.
WARNING_PHASES: frozenset[Phase] = frozenset({"Invalid", "CanaryFailed", "CanaryInconclusive", "Degraded"})
WARNING_REASONS = frozenset({Reason.ROLLING_BACK.value, Reason.ROLLED_BACK.value, Reason.APPLY_FAILED.value})


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The RFC 7386 merge patch turning `old` into `new` (empty when they are equal): removed keys become
    null, maps recurse, lists and scalars are replaced whole."""
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            nested = merge_patch(before, value)
            if nested:
                patch[key] = nested
        elif key not in old or before != value:
            patch[key] = value
    return patch


def without_empty_strings(value: Any) -> Any:
    """`value` with every "" map entry left out. Unpatched kube-apiserver 1.20 reads an empty string in a
    custom resource as null (kubernetes/kubernetes#99804), which the schema then rejects; every such
    status field defaults to "" when read back, so leaving it out says the same on any API server."""
    if isinstance(value, Mapping):
        return {key: without_empty_strings(item) for key, item in value.items() if item != ""}
    if isinstance(value, list):
        return [without_empty_strings(item) for item in value]
    return value


@dataclass(frozen=True)
class SpecRevisions:
    """Spec revisions (build.digests.spec_hash digests: status.*Revision), not pod template hashes nor model
    revisions."""

    desired: str
    serving: str
    failed: str | None
    last_good: str | None
    # Why the last good revision may not be rolled back to (its ConfigMap was changed); None: it may.
    rollback_refused: str | None = None

    @property
    def rolled_back(self) -> bool:
        return self.failed is not None and self.failed == self.desired and self.serving != self.desired


@dataclass(frozen=True)
class PhaseAndConditions:
    """What one reconcile reports in `status.phase` and `status.conditions`."""

    phase: Phase
    conditions: dict[ConditionType, ConditionState]


def invalid(problems: list[str]) -> PhaseAndConditions:
    message = "the spec is invalid: " + "; ".join(problems)
    not_reconciled = cond.unknown(Reason.INVALID_SPEC, "not reconciled: the spec is invalid")
    return PhaseAndConditions(
        "Invalid",
        {
            cond.MASTER_READY: not_reconciled,
            cond.REPLICAS_READY: not_reconciled,
            cond.CANARY_PASSED: not_reconciled,
            cond.READY: cond.false(Reason.INVALID_SPEC, message),
        },
    )


def apply_failed(message: str, previous: Phase | None) -> PhaseAndConditions:
    """The API server refused a child: Ready says which and why; the phase stays what it was."""
    unknown = cond.unknown(Reason.APPLY_FAILED, "not reconciled: applying a child failed")
    return PhaseAndConditions(
        previous or "Pending",
        {
            cond.MASTER_READY: unknown,
            cond.REPLICAS_READY: unknown,
            cond.CANARY_PASSED: unknown,
            cond.READY: cond.false(Reason.APPLY_FAILED, f"{message} (retried)"),
        },
    )


def _workload_conditions(observation: Observation) -> dict[ConditionType, ConditionState]:
    master, replicas = observation.master, observation.replicas
    return {
        cond.MASTER_READY: (
            cond.true(Reason.MASTER_READY, master.message)
            if master.ready
            else cond.false(Reason.MASTER_NOT_READY, master.message)
        ),
        cond.REPLICAS_READY: (
            cond.true(Reason.REPLICAS_READY, replicas.message)
            if replicas.all_ready
            else cond.false(Reason.REPLICAS_NOT_READY, replicas.message)
        ),
    }


def canary_condition(
    canary: CanaryStatus | None, revisions: SpecRevisions, *, enabled: bool
) -> ConditionState:
    """The last run's verdict when it was run against the serving revision; else pending."""
    if not enabled:
        return cond.unknown(Reason.CANARY_DISABLED, "canary.enabled is false")
    if canary is None or canary.target is None or canary.target.revision != revisions.serving:
        return cond.unknown(Reason.CANARY_PENDING, f"waiting for revision {revisions.serving} to be ready")
    message = f"run {canary.run_id} against revision {revisions.serving}: {canary.reason}"
    if canary.verdict == "Passed":
        return cond.true(Reason.CANARY_PASSED, message)
    if canary.verdict == "Failed":
        return cond.false(Reason.CANARY_FAILED, message)
    return cond.false(Reason.CANARY_INCONCLUSIVE, message)


def not_ready(
    observation: Observation, revisions: SpecRevisions, canary: CanaryStatus | None, *, enabled: bool
) -> PhaseAndConditions:
    """Master or replicas not ready: Pending before any pod exists, Deploying during a rollout, Degraded when
    a revision that already passed lost readiness."""
    workload = _workload_conditions(observation)
    detail = "; ".join(
        state.message for state in workload.values() if state.status != "True" and state.message
    )
    phase, ready = _not_ready_phase(observation, revisions, canary, detail)
    return PhaseAndConditions(
        phase,
        {
            **workload,
            cond.CANARY_PASSED: canary_condition(canary, revisions, enabled=enabled),
            cond.READY: ready,
        },
    )


def _not_ready_phase(
    observation: Observation, revisions: SpecRevisions, canary: CanaryStatus | None, detail: str
) -> tuple[Phase, ConditionState]:
    if revisions.rolled_back:
        message = f"revision {revisions.desired} failed the canary; rolling back to {revisions.serving}"
        return "Deploying", cond.false(Reason.ROLLING_BACK, f"{message}: {detail}")
    if not observation.has_pods:
        return "Pending", cond.false(Reason.PENDING, f"waiting for pods: {detail}")
    if revisions.last_good == revisions.serving and _proven(canary, revisions):
        message = f"revision {revisions.serving} lost readiness: {detail}"
        return "Degraded", cond.false(Reason.REPLICAS_LOST, message)
    return "Deploying", cond.false(Reason.DEPLOYING, f"rolling out revision {revisions.serving}: {detail}")


def _proven(canary: CanaryStatus | None, revisions: SpecRevisions) -> bool:
    return canary is not None and canary.target is not None and canary.target.revision == revisions.serving


def canary_running(observation: Observation, revisions: SpecRevisions, why: str) -> PhaseAndConditions:
    running = cond.unknown(Reason.CANARY_RUNNING, f"revision {revisions.serving}: {why}")
    return PhaseAndConditions(
        "Canary",
        {
            **_workload_conditions(observation),
            cond.CANARY_PASSED: running,
            cond.READY: cond.false(
                Reason.CANARY_RUNNING, f"canary running against revision {revisions.serving}: {why}"
            ),
        },
    )


def settled(
    observation: Observation,
    revisions: SpecRevisions,
    canary: CanaryStatus | None,
    *,
    enabled: bool,
    on_failure: str,
) -> PhaseAndConditions:
    """Master and replicas ready; the last canary (or none, when disabled) decides."""
    workload = _workload_conditions(observation)
    canary_state = canary_condition(canary, revisions, enabled=enabled)
    conditions = {**workload, cond.CANARY_PASSED: canary_state}
    if canary_state.status == "True" or not enabled:
        if revisions.rolled_back:
            message = (
                f"revision {revisions.desired} failed the canary and was rolled back; serving the last "
                f"good revision {revisions.serving}. Change the spec, or set the rerun-canary annotation "
                "to retry it"
            )
            return PhaseAndConditions(
                "Degraded", {**conditions, cond.READY: cond.false(Reason.ROLLED_BACK, message)}
            )
        message = (
            f"revision {revisions.serving} serving; canary passed"
            if enabled
            else f"revision {revisions.serving} serving; canary disabled"
        )
        return PhaseAndConditions("Ready", {**conditions, cond.READY: cond.true(Reason.READY, message)})
    if canary_state.reason is Reason.CANARY_PENDING:
        return PhaseAndConditions(
            "Canary", {**conditions, cond.READY: cond.false(Reason.CANARY_PENDING, canary_state.message)}
        )
    held = " Replicas that failed are out of the client Service." if on_failure == "Hold" else ""
    if revisions.rollback_refused:
        held += f" Rollback refused: {revisions.rollback_refused}."
    if canary_state.reason is Reason.CANARY_INCONCLUSIVE:
        # Retried by the operator after --inconclusive-retry-seconds: its own phase, never CanaryFailed.
        retried = " Run again by the operator; unproven pods stay out of the client Service."
        message = canary_state.message + retried
        return PhaseAndConditions(
            "CanaryInconclusive", {**conditions, cond.READY: cond.false(canary_state.reason, message)}
        )
    return PhaseAndConditions(
        "CanaryFailed",
        {**conditions, cond.READY: cond.false(canary_state.reason, canary_state.message + held)},
    )


def rolling_back(
    observation: Observation, revisions: SpecRevisions, canary: CanaryStatus
) -> PhaseAndConditions:
    """The spec's revision just failed; the last good one is about to be rendered again."""
    failed = cond.false(
        Reason.CANARY_FAILED, f"run {canary.run_id} against revision {revisions.desired}: {canary.reason}"
    )
    message = (
        f"revision {revisions.desired} failed the canary; rolling back to the last good revision "
        f"{revisions.last_good}"
    )
    return PhaseAndConditions(
        "Deploying",
        {
            **_workload_conditions(observation),
            cond.CANARY_PASSED: failed,
            cond.READY: cond.false(Reason.ROLLING_BACK, message),
        },
    )


def event_type(phase: Phase, reason: str) -> str:
    warning = phase in WARNING_PHASES or reason in WARNING_REASONS
    return "Warning" if warning else "Normal"


def still_rolling(reported: PhaseAndConditions, message: str) -> PhaseAndConditions:
    """An InPlace rollout's canary passed for the pods of the new template, but pods of the previous one
    remain (or the surge is still up): not Ready until the rollout is done."""
    ready = cond.false(Reason.DEPLOYING, message)
    return PhaseAndConditions("Deploying", {**reported.conditions, cond.READY: ready})
