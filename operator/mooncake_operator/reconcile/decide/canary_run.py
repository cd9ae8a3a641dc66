"""What a finished canary run means for the resource (pure): the verdict the spec's policy records, the
status evidence, the pods a failure blames and the Event about pairs that passed over a benign divergence;
or, when it could not run, why. `act.core` runs the canary and hands its result here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from mooncake_operator.api.spec import MooncakeServingSpec
from mooncake_operator.api.status import CanaryStatus, CanaryTarget
from mooncake_operator.canary.models import CanaryResult, Verdict
from mooncake_operator.canary.policy import effective_verdict
from mooncake_operator.canary.status import (
    benign_divergence_message,
    blamed_replicas,
    canary_status,
    not_run_status,
)
from mooncake_operator.reconcile.decide.actions import PostEvent


@dataclass(frozen=True)
class CanaryRun:
    """A run that just finished: its evidence, the pods a failure blames, and the Events it posts (the
    first actions of the decision after the run)."""

    canary: CanaryStatus
    blamed: tuple[str, ...] = ()
    events: tuple[PostEvent, ...] = ()


def not_run(reason: str, *, run_id: str, now: datetime, target: CanaryTarget) -> CanaryRun:
    """A run that could not start or finish (no URLs to use, the operator's deadline): Inconclusive."""
    return CanaryRun(not_run_status(reason, run_id=run_id, now=now, target=target))


def judge(
    result: CanaryResult, spec: MooncakeServingSpec, *, target: CanaryTarget, pod_names: Sequence[str]
) -> CanaryRun:
    """The run as the resource records it: the verdict under the spec's policy, the evidence, the pods a
    failure blames, and an Event when pairs passed over a benign divergence."""
    verdict = effective_verdict(result, require_external_hit=spec.canary.require_external_hit)
    canary = canary_status(result, verdict=verdict, target=target, pod_names=pod_names)
    benign = benign_divergence_message(result, pod_names)
    # A pass over a divergence is never silent: the status holds it per pair, this Event says so.
    events = (
        () if benign is None else (PostEvent(reason="CanaryBenignDivergence", message=benign, type="Normal"),)
    )
    blamed = blamed_replicas(result, pod_names) if verdict is Verdict.FAILED else []
    return CanaryRun(canary, tuple(blamed), events)
