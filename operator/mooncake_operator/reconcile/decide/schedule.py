"""When the canary runs. A run records what it was run against (`CanaryTarget`); the next run is due when
the present state differs from that record, when the spec's interval has elapsed, or (for an
inconclusive run) when the retry delay has.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from mooncake_operator.api.canary_spec import CanarySpec
from mooncake_operator.api.status import CanaryStatus, CanaryTarget
from mooncake_operator.canary.status import parse_time


def current_target(
    *,
    revision: str,
    generation: int | None,
    replica_pods: Sequence[str],
    master_pod: str | None,
    master_restarts: int,
    rerun: str | None,
    master_leader: str | None = None,
) -> CanaryTarget:
    return CanaryTarget(
        revision=revision,
        generation=generation,
        replica_pods=list(replica_pods),
        master_pod=master_pod,
        master_restarts=master_restarts,
        rerun=rerun,
        master_leader=master_leader,
    )


def canary_due(
    last: CanaryStatus | None,
    target: CanaryTarget,
    *,
    now: datetime,
    interval_seconds: float | None,
    inconclusive_retry_seconds: float,
) -> str | None:
    """Why the canary must run now, or None when its last result still describes the replicas."""
    if last is None or last.target is None:
        return "no canary has run against these replicas yet"
    before = last.target
    if before.revision != target.revision:
        return f"revision {target.revision} is rolled out (last canary: {before.revision})"
    if before.generation != target.generation:
        return f"generation {target.generation} (last canary: {before.generation})"
    shrunk = set(target.replica_pods) < set(before.replica_pods) and last.verdict == "Passed"
    # Fewer pods, each proven by the last run (e.g. an InPlace rollout's surge pod removed): nothing new.
    if before.replica_pods != target.replica_pods and not shrunk:
        changed = sorted(set(target.replica_pods) - set(before.replica_pods))
        before_uids = {item.split("#")[0] for item in before.replica_pods}
        replaced = [item.split("=")[0] for item in changed if item.split("#")[0] not in before_uids]
        restarted = [item.split("=")[0] for item in changed if item.split("#")[0] in before_uids]
        parts = [f"replica pods replaced: {', '.join(replaced)}"] if replaced else []
        parts += [f"replica engines restarted in place: {', '.join(restarted)}"] if restarted else []
        return "; ".join(parts) or "replica pods replaced: scaled"
    if before.master_leader != target.master_leader:
        return f"the store master failed over (leader {before.master_leader} -> {target.master_leader})"
    if before.master_pod != target.master_pod or target.master_restarts > before.master_restarts:
        return "the store master restarted"
    if before.rerun != target.rerun:
        return f"re-run requested ({target.rerun})"
    finished = parse_time(last.finished_at)
    if finished is None:
        return "the last canary run did not finish"
    elapsed = (now - finished).total_seconds()
    if interval_seconds is not None and elapsed >= interval_seconds:
        return f"interval of {interval_seconds:g}s elapsed"
    if last.verdict == "Inconclusive" and elapsed >= inconclusive_retry_seconds:
        return "retrying an inconclusive run"
    return None


def interval_due_in(spec: CanarySpec, last: CanaryStatus | None, now: datetime) -> float | None:
    """Seconds until `spec.canary.intervalSeconds` has elapsed since the last run finished (None: no
    interval, no finished run, or it is already due, which this pass has just handled)."""
    finished = parse_time(last.finished_at) if last is not None else None
    if not spec.enabled or spec.interval_seconds is None or finished is None:
        return None
    remaining = spec.interval_seconds - (now - finished).total_seconds()
    return remaining if remaining > 0 else None
