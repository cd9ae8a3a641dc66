"""The canary's policy for a MooncakeServing spec (pure, no Kubernetes): the run's configuration, and the
verdict the operator records from a run's result.

One rule for everyone who proves a spec: the operator's reconcile, `canary --resource` and the sandbox.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import TypeAdapter

from mooncake_operator.api.resource import plain
from mooncake_operator.api.spec import MooncakeServingSpec
from mooncake_operator.canary.expectations import Expectation
from mooncake_operator.canary.models import (
    CanaryConfig,
    CanaryResult,
    Comparison,
    ComparisonMode,
    Divergence,
    DivergenceKind,
    SuiteEntry,
    Verdict,
)
from mooncake_operator.canary.request import reference_request

_EXPECTATIONS = TypeAdapter(list[Expectation])


def canary_request(spec: MooncakeServingSpec) -> dict[str, Any]:
    """The spec's request, or the reference deployment's; sent to the served model name unless the
    request names one."""
    if spec.canary.request is None:
        return {**reference_request(), "model": spec.model.name}
    request = plain(spec.canary.request)
    return request if "model" in request else {**request, "model": spec.model.name}


def canary_expectations(spec: MooncakeServingSpec) -> list[Expectation] | None:
    """The spec's expectations as the canary's checks; None: the canary's default (the reference
    deployment's)."""
    if spec.canary.expectations is None:
        return None
    return _EXPECTATIONS.validate_python([item.model_dump() for item in spec.canary.expectations])


def canary_comparison(spec: MooncakeServingSpec) -> Comparison:
    comparison = spec.canary.comparison
    return Comparison(
        mode=ComparisonMode(comparison.mode),
        top_k=comparison.top_k,
        max_tie_gap_nats=comparison.max_tie_gap_nats,
        max_drift_nats=comparison.max_drift_nats,
    )


def canary_suite(spec: MooncakeServingSpec) -> Literal["default", "off"] | list[SuiteEntry]:
    """Unset: the default block-boundary suite; []: none; else the spec's requests (to the served model
    unless they name one)."""
    if spec.canary.suite is None:
        return "default"
    if not spec.canary.suite:
        return "off"
    entries = []
    for item in spec.canary.suite:
        request = plain(item.request)
        expectations = None
        if item.expectations is not None:
            expectations = _EXPECTATIONS.validate_python([check.model_dump() for check in item.expectations])
        entries.append(
            SuiteEntry(
                name=item.name,
                request=request if "model" in request else {**request, "model": spec.model.name},
                expectations=expectations,
            )
        )
    return entries


def canary_config(spec: MooncakeServingSpec, urls: Sequence[str]) -> CanaryConfig:
    options: dict[str, Any] = {
        "replicas": list(urls),
        "request": canary_request(spec),
        "pairs": spec.canary.pairs,
        "request_timeout_s": float(spec.canary.timeout_seconds),
        # The reader must load every block the prompt's hit should give (block size, Eagle's drop).
        "block_size": spec.engine.block_size,
        "eagle": spec.speculative is not None,
        "comparison": canary_comparison(spec),
        "suite": canary_suite(spec),
        # `canary --put-wait` overrides it for `canary --resource` (a HOW flag).
        "put_wait_s": spec.canary.put_wait_seconds,
    }
    if spec.canary.max_chat_body_bytes is not None:
        options["max_chat_body_bytes"] = spec.canary.max_chat_body_bytes
    if spec.canary.max_metrics_body_bytes is not None:
        options["max_metrics_body_bytes"] = spec.canary.max_metrics_body_bytes
    expectations = canary_expectations(spec)
    if expectations is not None:
        options["expectations"] = expectations
    return CanaryConfig(**options)


def effective_verdict(result: CanaryResult, *, require_external_hit: bool) -> Verdict:
    """The run's verdict; without `requireExternalHit`, a run whose every Inconclusive pair lacks only the
    proof of the reader's load (its answers proven equal, its cold answer proven cold) passes."""
    if result.verdict is not Verdict.INCONCLUSIVE or require_external_hit:
        return result.verdict
    proven_equal = all(
        (pair.answers_equal or benign(pair.divergence))
        and not pair.connection_error
        and (pair.verdict is Verdict.PASSED or pair.only_load_unproven)
        for pair in result.pairs
    )
    return Verdict.PASSED if proven_equal else Verdict.INCONCLUSIVE


def benign(divergence: Divergence | None) -> bool:
    return divergence is not None and divergence.kind is DivergenceKind.BENIGN
