"""spec.canary: what the warm/cold canary sends, checks and compares, and what a failure does. The
canary's own rules validate it, so every reader of the models (build, crd, the operator) refuses the
same resources.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from mooncake_operator.api.base import ApiModel, describe_validation_error
from mooncake_operator.canary.defaults import (
    DEFAULT_MAX_DRIFT_NATS,
    DEFAULT_MAX_TIE_GAP_NATS,
    DEFAULT_PUT_WAIT_S,
    DEFAULT_TOP_K,
    MAX_BODY_BYTES_LIMIT,
    MAX_PUT_WAIT_S,
    MAX_TOP_K,
)
from mooncake_operator.canary.expectations import Expectation
from mooncake_operator.canary.models import MAX_SUITE_REQUESTS, SUITE_NAME_PATTERN, check_chat_request

_EXPECTATIONS: TypeAdapter[list[Expectation]] = TypeAdapter(list[Expectation])


class ExpectationSpec(BaseModel):
    """One content check, e.g. {kind: json_values_include, values: [us-west, 4, 16]}."""

    # The other fields depend on `kind`; CanarySpec validates the list with the canary's own types, so
    # render, crd and the operator refuse the same checks. The schema stays open (kinds may be added).

    model_config = ConfigDict(frozen=True, extra="allow", strict=True)

    kind: str = Field(min_length=1, description="The check, e.g. json_object_only, json_values_include.")


class ComparisonSpec(ApiModel):
    """How the warm answer is compared with the cold one (docs/canary.md: the rule and its sources)."""

    mode: Literal["exact", "logprobs"] = Field(
        default="logprobs",
        description=(
            "logprobs: identical tokens pass; at the first divergence both answers' logprobs decide a "
            "benign near tie (passes, reported) from corruption. exact: token for token, for replicas "
            "on batch-invariant kernels."
        ),
    )
    top_k: int = Field(
        default=DEFAULT_TOP_K, ge=1, le=MAX_TOP_K, description="top_logprobs asked for per token."
    )
    max_tie_gap_nats: float = Field(
        default=DEFAULT_MAX_TIE_GAP_NATS,
        ge=0,
        le=10,
        description="Largest logprob gap between the two tokens, on each side, of a benign divergence.",
    )
    max_drift_nats: float = Field(
        default=DEFAULT_MAX_DRIFT_NATS,
        ge=0,
        le=10,
        description="Largest cold-versus-warm logprob change of a shared token before the divergence.",
    )

    @field_validator("max_tie_gap_nats", "max_drift_nats")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


class SuiteRequestSpec(ApiModel):
    """One more request each canary pair runs after spec.canary.request."""

    name: str = Field(pattern=SUITE_NAME_PATTERN, description="Shown in the report (a DNS label).")
    request: dict[str, Any] = Field(description="Chat-completions request body.")
    expectations: list[ExpectationSpec] | None = Field(
        default=None, description="Checks its answers must pass; unset: judged warm against cold only."
    )

    @field_validator("request")
    @classmethod
    def _request_the_canary_can_send(cls, request: dict[str, Any]) -> dict[str, Any]:
        check_chat_request(request)
        return request

    @field_validator("expectations")
    @classmethod
    def _checks_the_canary_knows(
        cls, expectations: list[ExpectationSpec] | None
    ) -> list[ExpectationSpec] | None:
        if expectations is not None:
            try:
                _EXPECTATIONS.validate_python([item.model_dump() for item in expectations])
            except ValidationError as error:
                raise ValueError("; ".join(describe_validation_error(error))) from None
        return expectations


class CanarySpec(ApiModel):
    enabled: bool = True
    request: dict[str, Any] | None = Field(
        default=None,
        description=(
            "Chat-completions request body sent to writer and reader. Unset: the reference deployment's "
            "deployment-record chat (docs/canary.md)."
        ),
    )
    expectations: list[ExpectationSpec] | None = Field(
        default=None,
        description=(
            "Checks every answer must pass, as in `mooncake-operator canary --expect`. Unset: the "
            "reference deployment's (one JSON object with the latest values, nothing before it); []: content "
            "checks off."
        ),
    )
    pairs: Literal["ring", "first"] = Field(
        default="ring", description="ring: every replica proven as writer and reader; first: replica 0 -> 1."
    )
    require_external_hit: bool = Field(
        default=True,
        description="Without a rise of the reader's external-hit counter the run is Inconclusive.",
    )
    timeout_seconds: int = Field(
        default=300,
        ge=1,
        description="Timeout of one canary request; lowered to the operator's ceiling (600 s by default).",
    )
    interval_seconds: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Re-run the canary this often; unset: only when something changes (a rollout, a replaced "
            "replica pod, a master restart or failover, the rerun annotation) and to retry an "
            "Inconclusive run."
        ),
    )
    on_failure: Literal["Hold", "Rollback"] = Field(
        default="Hold",
        description=(
            "Hold: keep the pods, take them out of the client Service. "
            "Rollback: restore the last good revision."
        ),
    )
    max_chat_body_bytes: int | None = Field(
        default=None,
        ge=1024,
        le=MAX_BODY_BYTES_LIMIT,
        description="Cap on one chat answer's body, decoded; unset: 4 MiB. Over it the run is Inconclusive.",
    )
    max_metrics_body_bytes: int | None = Field(
        default=None,
        ge=1024,
        le=MAX_BODY_BYTES_LIMIT,
        description="Cap on one metrics page, decoded; unset: 16 MiB. Over it the run is Inconclusive.",
    )
    put_wait_seconds: float = Field(
        default=DEFAULT_PUT_WAIT_S,
        ge=0,
        le=MAX_PUT_WAIT_S,
        description=(
            "After each cold answer, wait at most this long for the writer to report store puts covering "
            "the prompt's full blocks before the warm request is sent (the connector stores blocks "
            "asynchronously); the wait ends as soon as they are reported. A pair whose wait times out is "
            f"Inconclusive. 0: send the warm request at once. At most {MAX_PUT_WAIT_S:g}."
        ),
    )
    comparison: ComparisonSpec = Field(default_factory=lambda: ComparisonSpec())
    suite: list[SuiteRequestSpec] | None = Field(
        default=None,
        max_length=MAX_SUITE_REQUESTS,
        description=(
            "More requests each pair runs after `request`. Unset: the default block-boundary suite "
            "(prompts ending exactly on, one past and one short of a block boundary, and one of many "
            "blocks, padded with the replicas' own tokenizer); []: none."
        ),
    )

    @field_validator("put_wait_seconds", mode="before")
    @classmethod
    def _put_wait_in_range(cls, value: object) -> object:
        # Said here, with the reason, rather than as a bare bound: the wait runs once per pair.
        if isinstance(value, bool) or not isinstance(value, int | float):
            return value  # not a number: the field's type check says so
        if not (math.isfinite(value) and 0 <= value <= MAX_PUT_WAIT_S):
            raise ValueError(
                f"canary.putWaitSeconds must be a number of seconds from 0 (send the warm request at "
                f"once) to {MAX_PUT_WAIT_S:g}, got {value}: the canary waits up to this long in every "
                "pair for the writer's store puts; a store slower than that needs looking at, not a "
                "longer wait"
            )
        return value

    # The canary's own rules, so every reader of the models (render, crd, the operator) refuses the same
    # resources. `enabled` is declared first, so it is in `info.data` here. A disabled canary is not read.
    @field_validator("request")
    @classmethod
    def _request_the_canary_can_send(
        cls, request: dict[str, Any] | None, info: ValidationInfo
    ) -> dict[str, Any] | None:
        if request is not None and info.data.get("enabled", True):
            check_chat_request(request)
        return request

    @field_validator("expectations")
    @classmethod
    def _checks_the_canary_knows(
        cls, expectations: list[ExpectationSpec] | None, info: ValidationInfo
    ) -> list[ExpectationSpec] | None:
        if expectations is not None and info.data.get("enabled", True):
            try:
                _EXPECTATIONS.validate_python([item.model_dump() for item in expectations])
            except ValidationError as error:
                raise ValueError("; ".join(describe_validation_error(error))) from None
        return expectations
