"""The canary's result as the operator records it: a run -> CanaryStatus with one PairEvidence per pair,
the replicas a failure blames, the Event about pairs that passed over a benign divergence, and the RFC 3339
times of the status (no Kubernetes; the MooncakeServing API's status models).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from mooncake_operator.api.status import CanaryStatus, CanaryTarget, DivergenceEvidence, PairEvidence
from mooncake_operator.canary.models import (
    CanaryResult,
    ChatAnswer,
    Divergence,
    ErrorKind,
    PairResult,
    Verdict,
)
from mooncake_operator.canary.policy import benign

_REASON_LIMIT = 1000


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def benign_divergence_message(result: CanaryResult, pod_names: Sequence[str]) -> str | None:
    """The Event's message when pairs that passed did so over a benign divergence; None when none did."""
    names = dict(zip(result.replicas, pod_names, strict=False))
    passed = [
        f"{pair.request_name} {names.get(pair.writer, pair.writer)} -> "
        f"{names.get(pair.reader, pair.reader)}: {pair.divergence.describe()}"
        for pair in result.pairs
        if pair.verdict is Verdict.PASSED and pair.divergence is not None and benign(pair.divergence)
    ]
    if not passed:
        return None
    message = f"run {result.run_id}: {len(passed)} pair(s) passed over a benign divergence; " + "; ".join(
        passed
    )
    return message[:_REASON_LIMIT]


def _divergence_evidence(divergence: Divergence | None) -> DivergenceEvidence | None:
    if divergence is None:
        return None
    return DivergenceEvidence(
        position=divergence.position,
        kind=divergence.kind.value,
        cold_token=divergence.cold_token,
        warm_token=divergence.warm_token,
        cold_gap_nats=_rounded(divergence.cold_gap_nats),
        warm_gap_nats=_rounded(divergence.warm_gap_nats),
        max_drift_nats=_rounded(divergence.max_drift_nats),
        shared_tokens=divergence.shared_tokens,
        reasons=[reason[:_REASON_LIMIT] for reason in divergence.reasons],
    )


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _non_negative(value: int | None) -> int | None:
    # A counter that went down (the reader restarted mid-run) is no evidence.
    return value if value is not None and value >= 0 else None


def _draft_tokens(answer: ChatAnswer | None) -> int | None:
    if answer is None or answer.spec_decoding is None:
        return None
    return answer.spec_decoding.num_draft_tokens


def pair_evidence(pair: PairResult, names: dict[str, str]) -> PairEvidence:
    return PairEvidence(
        writer=names.get(pair.writer, pair.writer),
        reader=names.get(pair.reader, pair.reader),
        verdict=pair.verdict,
        reason="; ".join(pair.reasons)[:_REASON_LIMIT],
        cache_salt=pair.cache_salt,
        prompt_tokens=_non_negative(pair.prompt_tokens),
        external_hit_tokens=_non_negative(pair.external_hit_tokens),
        expected_external_hit_tokens=_non_negative(pair.expected_external_hit_tokens),
        load_get_keys=_non_negative(pair.load_get_keys),
        warm_cached_tokens=_non_negative(pair.warm.cached_tokens) if pair.warm else None,
        cold_cached_tokens=_non_negative(pair.cold.cached_tokens) if pair.cold else None,
        warm_draft_tokens=_draft_tokens(pair.warm),
        hit_evidence=pair.hit_evidence,
        put_wait=pair.put_wait.outcome if pair.put_wait else None,
        put_wait_ms=_ms(pair.put_wait.waited_s) if pair.put_wait else None,
        answers_equal=pair.answers_equal,
        cold_latency_ms=_ms(pair.cold.latency_s) if pair.cold else None,
        warm_latency_ms=_ms(pair.warm.latency_s) if pair.warm else None,
        first_mismatch=pair.mismatch,
        request=pair.request_name,
        divergence=_divergence_evidence(pair.divergence),
        violations=list(pair.expectation_violations),
        notes=list(pair.notes),
    )


def canary_status(
    result: CanaryResult,
    *,
    verdict: Verdict,
    target: CanaryTarget,
    pod_names: Sequence[str],
) -> CanaryStatus:
    """The run as status: evidence per pair, replicas named by pod (URLs are in the run's log)."""
    names = dict(zip(result.replicas, pod_names, strict=False))
    hits = [pair.external_hit_tokens for pair in result.pairs if pair.external_hit_tokens is not None]
    finished = result.started_at + timedelta(seconds=result.wall_s)
    reason = result.reason
    if verdict is not result.verdict:
        reason = f"passed without a proven external hit (requireExternalHit: false): {reason}"
    return CanaryStatus(
        run_id=result.run_id,
        verdict=verdict,
        reason=reason[:_REASON_LIMIT],
        external_hit_tokens=_non_negative(sum(hits)) if hits else None,
        started_at=format_time(result.started_at),
        finished_at=format_time(finished),
        pairs=[pair_evidence(pair, names) for pair in result.pairs],
        target=target,
    )


def not_run_status(reason: str, *, run_id: str, now: datetime, target: CanaryTarget) -> CanaryStatus:
    """An inconclusive "run" that could not start (e.g. the endpoint override lists the wrong count)."""
    stamp = format_time(now)
    return CanaryStatus(
        run_id=run_id,
        verdict=Verdict.INCONCLUSIVE,
        reason=reason,
        started_at=stamp,
        finished_at=stamp,
        target=target,
    )


def format_time(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _cold_at_fault(pair: PairResult) -> bool:
    cold_failed = pair.cold is None or (not pair.cold.ok and pair.cold.error_kind is not ErrorKind.CONNECTION)
    return cold_failed or any(v.startswith("cold answer") for v in pair.expectation_violations)


def blamed_replicas(result: CanaryResult, pod_names: Sequence[str]) -> list[str]:
    """Pods to take out of traffic after a failed run: a failed pair's reader (it answered from a loaded
    prefix: a corrupting reader), and its writer when the cold answer itself was wrong or missing."""
    names = dict(zip(result.replicas, pod_names, strict=False))
    blamed: set[str] = set()
    for pair in result.pairs:
        if pair.verdict is not Verdict.FAILED:
            continue
        cold_fault = _cold_at_fault(pair)
        if cold_fault:
            blamed.add(names.get(pair.writer, pair.writer))
        if pair.warm is not None or not cold_fault:
            blamed.add(names.get(pair.reader, pair.reader))
    return sorted(blamed)
