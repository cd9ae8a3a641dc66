"""Typed configuration and results of the canary (pydantic, so they print as JSON and validate input)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mooncake_operator.canary.expectations import Expectation
from mooncake_operator.canary.request import customer_expectations, customer_request


class Verdict(StrEnum):
    PASSED = "Passed"
    FAILED = "Failed"
    # The warm path was never proven to run (no counter rise, no metrics, unreachable replica).
    INCONCLUSIVE = "Inconclusive"


class ErrorKind(StrEnum):
    CONNECTION = "connection"  # no TCP connection after every retry: nothing was sent
    TIMEOUT = "timeout"  # connected, but no complete answer within the timeout
    DISCONNECTED = "disconnected"  # connected, but the connection broke before a complete answer
    HTTP_STATUS = "http_status"  # an answer other than 200
    MALFORMED = "malformed"  # a 200 that is not a chat completion


class ExitCode:
    """`mooncake-operator canary` exit statuses."""

    PASSED = 0
    FAILED = 1
    INCONCLUSIVE = 2
    USAGE_OR_CONNECTION = 3


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ChatAnswer(_Model):
    """One chat completion as the canary saw it; on error, what went wrong and an excerpt of the body."""

    url: str
    status: int | None = None
    text: str | None = None
    reasoning: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # usage.prompt_tokens_details.cached_tokens (local + external); vLLM sends it only with
    # --enable-prompt-tokens-details.
    cached_tokens: int | None = None
    latency_s: float = 0.0
    attempts: int = 1
    error_kind: ErrorKind | None = None
    error: str | None = None
    body_excerpt: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None and self.status == 200 and self.text is not None


class StoreCounters(_Model):
    """A replica's cache counters in tokens (keys for the store operations); None: metric absent."""

    external_hit_tokens: int | None = None
    external_query_tokens: int | None = None
    local_hit_tokens: int | None = None
    prompt_tokens_by_source: dict[str, int] = Field(default_factory=dict)
    store_keys_by_operation: dict[str, int] = Field(default_factory=dict)
    store_failed_keys_by_operation: dict[str, int] = Field(default_factory=dict)
    # How long the scrape took; 0 in a delta.
    latency_s: float = 0.0

    def delta(self, other: StoreCounters) -> StoreCounters:
        """How much each counter rose from `other` (the earlier reading) to this one."""
        return StoreCounters(
            external_hit_tokens=_minus(self.external_hit_tokens, other.external_hit_tokens),
            external_query_tokens=_minus(self.external_query_tokens, other.external_query_tokens),
            local_hit_tokens=_minus(self.local_hit_tokens, other.local_hit_tokens),
            prompt_tokens_by_source=_minus_all(self.prompt_tokens_by_source, other.prompt_tokens_by_source),
            store_keys_by_operation=_minus_all(self.store_keys_by_operation, other.store_keys_by_operation),
            store_failed_keys_by_operation=_minus_all(
                self.store_failed_keys_by_operation, other.store_failed_keys_by_operation
            ),
        )


class Mismatch(_Model):
    """Where the warm answer first differs from the cold one, with a little text around it."""

    position: int
    cold_context: str
    warm_context: str


class PairResult(_Model):
    index: int
    writer: str
    reader: str
    cache_salt: str
    verdict: Verdict
    reasons: list[str]
    # Evidence that does not decide the verdict (e.g. the double-prune signature in key counts).
    notes: list[str] = Field(default_factory=list)
    cold: ChatAnswer | None = None
    warm: ChatAnswer | None = None
    counters_before: StoreCounters | None = None
    counters_after: StoreCounters | None = None
    counters_delta: StoreCounters | None = None
    metrics_error: str | None = None
    prompt_tokens: int | None = None
    external_hit_tokens: int | None = None
    expected_external_hit_tokens: int | None = None
    load_get_keys: int | None = None
    answers_equal: bool | None = None
    mismatch: Mismatch | None = None
    expectation_violations: list[str] = Field(default_factory=list)
    connection_error: str | None = None
    wall_s: float = 0.0
    # Sum of this pair's chat and metrics request latencies: the part of wall_s spent waiting on replicas.
    request_latency_s: float = 0.0


class CanaryResult(_Model):
    run_id: str
    verdict: Verdict
    reason: str
    replicas: list[str]
    pairs_mode: Literal["ring", "first"]
    pairs: list[PairResult]
    expectations: list[str]
    block_size: int | None = None
    eagle: bool = False
    warnings: list[str] = Field(default_factory=list)
    started_at: datetime
    wall_s: float
    request_latency_s: float

    @property
    def connection_failed(self) -> bool:
        return any(pair.connection_error for pair in self.pairs)

    @property
    def exit_code(self) -> int:
        """0 passed, 1 failed, 2 inconclusive, 3 a replica could not be reached.

        A wrong answer outranks an unreachable replica: it is the finding that matters.
        """
        if self.verdict is Verdict.FAILED:
            return ExitCode.FAILED
        if self.connection_failed:
            return ExitCode.USAGE_OR_CONNECTION
        if self.verdict is Verdict.INCONCLUSIVE:
            return ExitCode.INCONCLUSIVE
        return ExitCode.PASSED


class CanaryConfig(_Model):
    """What to prove and how patiently.

    `expectations=[]` turns content checks off (reported as such); answers must still be equal.
    The hit the reader must show: `expected_external_hit_tokens` when given; else computed per pair
    from the cold answer's prompt tokens when `block_size` is given (`eagle` for a speculative
    Eagle config); else any rise above 0. A rise below the expected hit is Inconclusive (the warm
    path ran, but not over the whole prefix, so the blocks where a load bug would show may not have
    been loaded); a larger rise is accepted with a note (other traffic on the reader adds to it).
    """

    replicas: list[str] = Field(min_length=2)
    request: dict[str, Any] = Field(default_factory=customer_request)
    expectations: list[Expectation] = Field(default_factory=customer_expectations)
    pairs: Literal["ring", "first"] = "ring"
    request_timeout_s: float = Field(default=120.0, gt=0)
    metrics_timeout_s: float = Field(default=10.0, gt=0)
    connect_retries: int = Field(default=3, ge=0, le=20)
    retry_backoff_s: float = Field(default=0.5, ge=0, le=60)
    expected_external_hit_tokens: int | None = Field(default=None, ge=1)
    block_size: int | None = Field(default=None, ge=1)
    eagle: bool = False

    @field_validator("replicas")
    @classmethod
    def _replica_urls(cls, replicas: list[str]) -> list[str]:
        normalized = [normalize_base_url(url) for url in replicas]
        duplicates = sorted({url for url in normalized if normalized.count(url) > 1})
        if duplicates:
            raise ValueError(f"each replica must be listed once; repeated: {', '.join(duplicates)}")
        return normalized

    @field_validator("request")
    @classmethod
    def _chat_request(cls, request: dict[str, Any]) -> dict[str, Any]:
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("the request needs a non-empty 'messages' list (an OpenAI chat completion body)")
        if request.get("stream"):
            raise ValueError(
                "the request must not stream ('stream': true); the canary compares whole answers"
            )
        if request.get("n", 1) != 1:
            raise ValueError("the request must ask for one choice ('n': 1)")
        if "cache_salt" in request:
            raise ValueError("the request must not set 'cache_salt'; the canary sets a fresh one per pair")
        return request

    @model_validator(mode="after")
    def _one_source_of_expected_hit(self) -> CanaryConfig:
        if self.expected_external_hit_tokens is not None and self.block_size is not None:
            raise ValueError("give either expected_external_hit_tokens or block_size, not both")
        if self.eagle and self.block_size is None:
            raise ValueError("eagle needs block_size to compute the expected hit")
        return self


def normalize_base_url(url: str) -> str:
    """`http://host:8000/`, `http://host:8000/v1` -> `http://host:8000`; anything but http(s) is refused."""
    stripped = url.strip().rstrip("/")
    scheme, separator, rest = stripped.partition("://")
    if not separator or scheme.lower() not in ("http", "https") or not rest or rest.startswith("/"):
        raise ValueError(f"replica URL {url!r} must look like http://HOST:PORT")
    if any(char.isspace() for char in rest):
        raise ValueError(f"replica URL {url!r} contains whitespace")
    return stripped.removesuffix("/v1")


def _minus(later: int | None, earlier: int | None) -> int | None:
    return None if later is None or earlier is None else later - earlier


def _minus_all(later: dict[str, int], earlier: dict[str, int]) -> dict[str, int]:
    return {key: later.get(key, 0) - earlier.get(key, 0) for key in sorted(later.keys() | earlier.keys())}
