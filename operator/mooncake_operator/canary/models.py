"""Typed configuration and results of the canary (pydantic, so they print as JSON and validate input)."""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from enum import StrEnum
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mooncake_operator import exit_codes
from mooncake_operator.canary.defaults import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_MAX_CHAT_BODY_BYTES,
    DEFAULT_MAX_DRIFT_NATS,
    DEFAULT_MAX_METRICS_BODY_BYTES,
    DEFAULT_MAX_TIE_GAP_NATS,
    DEFAULT_PUT_WAIT_S,
    DEFAULT_TOP_K,
    MAX_BODY_BYTES_LIMIT,
    MAX_PUT_WAIT_S,
    MAX_TOP_K,
)
from mooncake_operator.canary.expectations import Expectation
from mooncake_operator.canary.request import reference_expectations, reference_request
from mooncake_operator.canary.urls import redact_url as redact_url


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
    TOO_LARGE = "too_large"  # the body passed its cap (decoded size): not read further


class ExitCode:
    """Exit statuses of `mooncake-operator canary` and `sandbox`: the CLI's one table (exit_codes)."""

    PASSED = exit_codes.SUCCESS
    FAILED = exit_codes.FAILED  # a wrong or missing answer: a finding about the replicas
    INCONCLUSIVE = exit_codes.INCONCLUSIVE  # the answers may be fine, but the warm path was not proven
    # Nothing could be judged: bad arguments or input files, an unreachable replica, a sandbox set-up error.
    USAGE_OR_ENVIRONMENT = exit_codes.USAGE
    INTERNAL_ERROR = exit_codes.INTERNAL_ERROR
    INTERRUPTED = exit_codes.INTERRUPTED
    TERMINATED = exit_codes.TERMINATED


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ComparisonMode(StrEnum):
    # Token for token, no divergence allowed: for replicas on batch-invariant kernels. The logprobs are
    # asked for and judged as in LOGPROBS (identical tokens over a moved distribution are corruption).
    EXACT = "exact"
    # Identical tokens pass when their distributions agree; at the first divergence the two
    # distributions decide benign or not.
    LOGPROBS = "logprobs"


class Comparison(_Model):
    """How a warm answer is compared with the cold one (spec.canary.comparison, `canary --compare`)."""

    mode: ComparisonMode = ComparisonMode.LOGPROBS
    top_k: int = Field(default=DEFAULT_TOP_K, ge=1, le=MAX_TOP_K)
    max_tie_gap_nats: float = Field(default=DEFAULT_MAX_TIE_GAP_NATS, ge=0, le=10, allow_inf_nan=False)
    max_drift_nats: float = Field(default=DEFAULT_MAX_DRIFT_NATS, ge=0, le=10, allow_inf_nan=False)


class TopLogprob(_Model):
    token_id: int = Field(ge=0)
    logprob: float


class TokenLogprob(_Model):
    """One generated token, by id (vLLM's `return_tokens_as_token_ids`: `token_id:N`): its logprob and
    the replica's top alternatives at that step, in the order the replica sent them."""

    token_id: int = Field(ge=0)
    logprob: float
    top: list[TopLogprob] = Field(default_factory=list)


def token_name(token_id: int | None) -> str | None:
    """How a token is shown: vLLM's own placeholder for a token id."""
    return None if token_id is None else f"token_id:{token_id}"


class SpecDecoding(_Model):
    """The answer's own speculative-decoding metrics (`metrics.speculative_decoding`, vLLM's
    `--per-request-spec-decode-metrics summary`): what the drafter did for this request alone."""

    num_spec_steps: int = Field(ge=0)
    num_draft_tokens: int = Field(ge=0)
    num_accepted_draft_tokens: int = Field(ge=0)
    num_spec_tokens: int = Field(ge=0)


class DivergenceKind(StrEnum):
    BENIGN = "benign"  # a near tie tipped by numerics: passes, reported
    CORRUPTION = "corruption"  # the distributions disagree beyond numerics: Failed
    UNJUDGED = "unjudged"  # no distribution to judge by (no logprobs returned): Inconclusive


class Divergence(_Model):
    """The first token where the warm answer leaves the cold one, and the evidence that judged it.

    Gaps are |logprob(own token) - logprob(the other side's token)| in one side's distribution; None
    when the other side's token is not in that side's top list. Ranks are 1-based in the top list.
    Token drifts are |cold - warm| logprob of each candidate token at the divergence (the two sides
    share the prefix up to it, so their distributions there must agree within the drift bound).
    """

    position: int = Field(ge=0, description="Index of the first differing token.")
    cold_token: str | None = Field(default=None, description="None: the cold answer ended here.")
    warm_token: str | None = Field(default=None, description="None: the warm answer ended here.")
    cold_token_id: int | None = None
    warm_token_id: int | None = None
    cold_token_drift_nats: float | None = None
    warm_token_drift_nats: float | None = None
    kind: DivergenceKind
    cold_gap_nats: float | None = None
    warm_gap_nats: float | None = None
    warm_token_rank_in_cold: int | None = None
    cold_token_rank_in_warm: int | None = None
    shared_tokens: int = Field(default=0, ge=0, description="Tokens before the divergence.")
    max_drift_nats: float | None = Field(
        default=None,
        description="Largest cold-versus-warm logprob change over the top lists of the shared positions "
        "and the divergence itself.",
    )
    drift_position: int | None = None
    top_k: int
    max_tie_gap_nats_allowed: float
    max_drift_nats_allowed: float
    reasons: list[str] = Field(default_factory=list, description="Why it is not benign.")

    def describe(self) -> str:
        gaps = ", ".join(
            f"{side} gap {_nats(gap)}"
            for side, gap in (("cold", self.cold_gap_nats), ("warm", self.warm_gap_nats))
        )
        drift = _nats(self.max_drift_nats) if self.max_drift_nats is not None else "none (no shared tokens)"
        return (
            f"{self.kind.value} divergence at token {self.position}: cold {self.cold_token!r}, warm "
            f"{self.warm_token!r}; {gaps} (allowed {self.max_tie_gap_nats_allowed:g}); drift before it "
            f"{drift} over {self.shared_tokens} tokens (allowed {self.max_drift_nats_allowed:g}); "
            f"top-{self.top_k}"
        )


def _nats(value: float | None) -> str:
    return "not in top list" if value is None else f"{value:.4f} nat"


class ChatAnswer(_Model):
    """One chat completion as the canary saw it; on error, what went wrong and an excerpt of the body."""

    url: str
    status: int | None = None
    text: str | None = None
    model: str | None = None  # the model the answer names
    reasoning: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # usage.prompt_tokens_details.cached_tokens (local + external); vLLM sends it only with
    # --enable-prompt-tokens-details.
    cached_tokens: int | None = None
    # metrics.speculative_decoding; vLLM sends it only with --per-request-spec-decode-metrics.
    spec_decoding: SpecDecoding | None = None
    # Per generated token, when asked for (`logprobs`, `top_logprobs`); None: none usable (see below).
    logprobs: list[TokenLogprob] | None = None
    # Why the logprobs the server sent cannot be judged (tokens that are not ids, short top lists);
    # None when they can or none were sent.
    logprobs_problem: str | None = None
    latency_s: float = 0.0
    attempts: int = 1
    error_kind: ErrorKind | None = None
    error: str | None = None
    body_excerpt: str | None = None

    @property
    def ok(self) -> bool:
        """A chat completion: content, or reasoning alone (a reasoning model whose budget ended in it)."""
        return (
            self.error_kind is None
            and self.status == 200
            and (self.text is not None or self.reasoning is not None)
        )

    @property
    def generation(self) -> str:
        """The whole generated text as the replica split it: reasoning, then content."""
        return (self.reasoning or "") + (self.text or "")

    @property
    def truncated(self) -> bool:
        """The answer stopped at its token budget: its end was never written."""
        return self.finish_reason == "length"


class StoreCounters(_Model):
    """A replica's cache counters in tokens (keys for the store operations); None: metric absent."""

    external_hit_tokens: int | None = None
    external_query_tokens: int | None = None
    local_hit_tokens: int | None = None
    prompt_tokens_by_source: dict[str, int] = Field(default_factory=dict)
    store_keys_by_operation: dict[str, int] = Field(default_factory=dict)
    store_failed_keys_by_operation: dict[str, int] = Field(default_factory=dict)
    # Speculative decoding (Eagle): drafts proposed, draft tokens, accepted tokens; None: not served.
    spec_decode_drafts: int | None = None
    spec_decode_draft_tokens: int | None = None
    spec_decode_accepted_tokens: int | None = None
    # What the replica served (attribution of a counter rise to the canary's own request): requests
    # finished (vllm:request_success_total) and prompt tokens prefilled (vllm:prompt_tokens_total).
    requests_finished: int | None = None
    prompt_tokens: int | None = None
    # Gauges at the time of the read (vllm:num_requests_running / _waiting); None in a delta.
    requests_running: int | None = None
    requests_waiting: int | None = None
    # Whether the page declares the Mooncake store's operation counters (their series appear with the
    # first operation, the family's HELP/TYPE lines at start-up).
    store_metrics_declared: bool = False
    # How long the scrape took; 0 in a delta.
    latency_s: float = 0.0

    @property
    def save_put_ok_keys(self) -> int:
        keys = self.store_keys_by_operation.get("save_put", 0)
        return keys - self.store_failed_keys_by_operation.get("save_put", 0)

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
            spec_decode_drafts=_minus(self.spec_decode_drafts, other.spec_decode_drafts),
            spec_decode_draft_tokens=_minus(self.spec_decode_draft_tokens, other.spec_decode_draft_tokens),
            spec_decode_accepted_tokens=_minus(
                self.spec_decode_accepted_tokens, other.spec_decode_accepted_tokens
            ),
            requests_finished=_minus(self.requests_finished, other.requests_finished),
            prompt_tokens=_minus(self.prompt_tokens, other.prompt_tokens),
            store_metrics_declared=self.store_metrics_declared,
        )


# Also the status's `firstMismatch` (api.PairEvidence): one shape from the canary to `kubectl get`.
class Mismatch(_Model):
    """Where the warm answer first differs from the cold one, with a little text around it."""

    position: int = Field(ge=0, description="Index of the first differing character.")
    cold: str = Field(description="Cold (writer) text around the mismatch.")
    warm: str = Field(description="Warm (reader) text around the mismatch.")


class PutWaitOutcome(StrEnum):
    COVERED = "covered"  # the writer reported puts covering the prompt's full blocks
    TIMEOUT = "timeout"  # it had not within the wait
    FAILED = "failed"  # the writer reported failed puts
    NO_STORE_METRICS = "no_store_metrics"  # the writer's page declares no Mooncake store counters
    UNAVAILABLE = "unavailable"  # the writer's counters could not be read
    OFF = "off"  # put_wait_s 0: the warm request is sent at once


class PutWait(_Model):
    """How long the canary waited for the writer's store puts before it sent the warm request."""

    outcome: PutWaitOutcome
    waited_s: float = Field(ge=0)
    polls: int = Field(default=0, ge=0, description="Writer metrics reads after the cold answer.")
    keys_needed: int | None = Field(
        default=None,
        description="save_put keys that cover the prompt's full blocks (at least one per block); None: "
        "without a block size, any put.",
    )
    keys_reported: int | None = Field(default=None, description="save_put keys (ok) the writer reported.")
    failed_keys: int | None = None

    def describe(self) -> str:
        needed = f"{self.keys_needed} keys (the prompt's full blocks)" if self.keys_needed else "any put"
        seen = f"{self.keys_reported} reported" if self.keys_reported is not None else "none read"
        return f"{self.outcome.value} after {self.waited_s:.3f} s waiting for {needed}, {seen}"


class LogprobEvidence(_Model):
    """The logprob comparison over every position both answers share (and the divergence, if any)."""

    positions: int = Field(ge=0, description="Positions whose distributions were compared.")
    max_drift_nats: float | None = Field(
        default=None,
        description="Largest cold-versus-warm logprob change found (a lower bound where a "
        "token was in one side's top list only).",
    )
    drift_position: int | None = None
    drift_token_id: int | None = None
    drift_bounded: bool = Field(
        default=False, description="The largest drift is a bound: the token was in one top list only."
    )
    max_drift_nats_allowed: float


class SharedText(_Model):
    """The text of the tokens both answers share before a divergence, decoded by the writer
    (`POST /detokenize`), or why it could not be."""

    tokens: int = Field(ge=0)
    text: str | None = None
    error: str | None = None
    latency_s: float = 0.0


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
    # The writer's counters' rise over the pair (explains a reader that found nothing; never decides).
    writer_counters_delta: StoreCounters | None = None
    metrics_error: str | None = None
    prompt_tokens: int | None = None
    external_hit_tokens: int | None = None
    expected_external_hit_tokens: int | None = None
    load_get_keys: int | None = None
    answers_equal: bool | None = None
    mismatch: Mismatch | None = None
    # The first differing token, judged (logprobs mode); reported whether it passed or not.
    divergence: Divergence | None = None
    # The distributions compared at every shared position.
    logprob_evidence: LogprobEvidence | None = None
    # The text of the shared tokens before a divergence (checked against both answers).
    shared_text: SharedText | None = None
    put_wait: PutWait | None = None
    # Where the reader's load was proven from: "answer" (its own usage.prompt_tokens_details), "counters"
    # (a counter rise attributable to the warm request alone), None (not proven).
    hit_evidence: Literal["answer", "counters"] | None = None
    # Inconclusive only because the reader's load was not proven (the answers were proven equal, the
    # cold answer proven cold): what `requireExternalHit: false` accepts.
    only_load_unproven: bool = False
    request_name: str = "request"
    expectation_violations: list[str] = Field(default_factory=list)
    connection_error: str | None = None
    wall_s: float = 0.0
    # Sum of this pair's chat and metrics request latencies: the part of wall_s spent waiting on replicas.
    request_latency_s: float = 0.0
    # The writer's metrics reads: before the cold request, then while waiting for its puts.
    writer_metrics_reads: int = 0


class RunCost(_Model):
    """What a run cost the replicas: chat requests sent and the tokens they counted (usage)."""

    chat_requests: int = 0
    metrics_reads: int = 0  # the readers'
    writer_metrics_reads: int = 0  # the writers' (the cold proof and the wait for their puts)
    detokenize_requests: int = 0  # the shared text before a benign divergence
    put_wait_s: float = 0.0  # time spent waiting for the writers' puts
    prompt_tokens: int = 0
    completion_tokens: int = 0


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
    comparison: Comparison = Field(default_factory=lambda: Comparison())
    requests: list[str] = Field(default_factory=list, description="Names of the requests each pair ran.")
    cost: RunCost = Field(default_factory=lambda: RunCost())
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
            return ExitCode.USAGE_OR_ENVIRONMENT
        if self.verdict is Verdict.INCONCLUSIVE:
            return ExitCode.INCONCLUSIVE
        return ExitCode.PASSED


SUITE_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
PRIMARY_REQUEST_NAME = "request"
MAX_SUITE_REQUESTS = 16


class SuiteEntry(_Model):
    """One request of a canary suite. `expectations` None or []: judged warm against cold only."""

    name: str = Field(pattern=SUITE_NAME_PATTERN, description="Shown in the report (a DNS label).")
    request: dict[str, Any]
    expectations: list[Expectation] | None = None

    @field_validator("request")
    @classmethod
    def _chat_request(cls, request: dict[str, Any]) -> dict[str, Any]:
        check_chat_request(request)
        return request


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
    request: dict[str, Any] = Field(default_factory=reference_request)
    expectations: list[Expectation] = Field(default_factory=reference_expectations)
    pairs: Literal["ring", "first"] = "ring"
    request_timeout_s: float = Field(default=120.0, gt=0, allow_inf_nan=False)
    metrics_timeout_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    connect_timeout_s: float = Field(default=DEFAULT_CONNECT_TIMEOUT_S, gt=0, allow_inf_nan=False)
    max_chat_body_bytes: int = Field(default=DEFAULT_MAX_CHAT_BODY_BYTES, ge=1024, le=MAX_BODY_BYTES_LIMIT)
    max_metrics_body_bytes: int = Field(
        default=DEFAULT_MAX_METRICS_BODY_BYTES, ge=1024, le=MAX_BODY_BYTES_LIMIT
    )
    connect_retries: int = Field(default=3, ge=0, le=20)
    retry_backoff_s: float = Field(default=0.5, ge=0, le=60, allow_inf_nan=False)
    expected_external_hit_tokens: int | None = Field(default=None, ge=1)
    # After the cold answer, wait at most this long for the writer's store puts (0: not at all).
    put_wait_s: float = Field(default=DEFAULT_PUT_WAIT_S, ge=0, le=MAX_PUT_WAIT_S, allow_inf_nan=False)
    block_size: int | None = Field(default=None, ge=1)
    # With Eagle the reader's speculative-decoding counters must also rise over the warm request.
    eagle: bool = False
    comparison: Comparison = Field(default_factory=lambda: Comparison())
    # More requests each pair runs after `request`: "default", the block-boundary suite built for the
    # replicas' tokenizer at run time (needs block_size; canary.request.default_suite); "off"; or these.
    suite: Literal["default", "off"] | list[SuiteEntry] = "off"

    @field_validator("replicas")
    @classmethod
    def _replica_urls(cls, replicas: list[str]) -> list[str]:
        normalized = [normalize_base_url(url) for url in replicas]
        # Linear: one count per distinct replica (credentials do not make another replica).
        counts = Counter(redact_url(url, mask="") for url in normalized)
        duplicates = sorted(url for url, count in counts.items() if count > 1)
        if duplicates:
            raise ValueError(f"each replica must be listed once; repeated: {', '.join(duplicates)}")
        return normalized

    @field_validator("request")
    @classmethod
    def _chat_request(cls, request: dict[str, Any]) -> dict[str, Any]:
        check_chat_request(request)
        return request

    @field_validator("suite")
    @classmethod
    def _distinct_names(cls, suite: object) -> object:
        if isinstance(suite, list):
            if len(suite) > MAX_SUITE_REQUESTS:
                raise ValueError(f"a suite holds at most {MAX_SUITE_REQUESTS} requests, got {len(suite)}")
            names = [entry.name for entry in suite]
            repeated = sorted(
                {name for name in names if names.count(name) > 1 or name == PRIMARY_REQUEST_NAME}
            )
            if repeated:
                raise ValueError(
                    f"suite request names must be distinct and not {PRIMARY_REQUEST_NAME!r}: "
                    + ", ".join(repeated)
                )
        return suite

    def primary_request(self) -> SuiteEntry:
        """`request` with `expectations`, as the first request of every pair."""
        return SuiteEntry(name=PRIMARY_REQUEST_NAME, request=self.request, expectations=self.expectations)

    @model_validator(mode="after")
    def _one_source_of_expected_hit(self) -> CanaryConfig:
        if self.expected_external_hit_tokens is not None and self.block_size is not None:
            raise ValueError("give either expected_external_hit_tokens or block_size, not both")
        if self.eagle and self.block_size is None:
            raise ValueError("eagle needs block_size to compute the expected hit")
        if self.suite == "default" and self.block_size is None:
            raise ValueError("the default suite needs block_size (its prompts end on block boundaries)")
        return self


def check_chat_request(request: dict[str, Any]) -> None:
    """Raises ValueError when `request` is not a body the canary can send (also the API's rule)."""
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("the request needs a non-empty 'messages' list (an OpenAI chat completion body)")
    if request.get("stream"):
        raise ValueError("the request must not stream ('stream': true); the canary compares whole answers")
    if request.get("n", 1) != 1:
        raise ValueError("the request must ask for one choice ('n': 1)")
    if "cache_salt" in request:
        raise ValueError("the request must not set 'cache_salt'; the canary sets a fresh one per pair")
    asked = sorted(key for key in CANARY_REQUEST_FIELDS if key in request)
    if asked:
        raise ValueError(
            f"the request must not set {' or '.join(repr(key) for key in asked)}; the canary asks for "
            "logprobs by token id itself (comparison.topK)"
        )


# What the canary adds to every chat request it sends (besides cache_salt): a request must not set them.
CANARY_REQUEST_FIELDS = ("logprobs", "top_logprobs", "return_tokens_as_token_ids")


_DEFAULT_PORTS = {"http": 80, "https": 443}


def normalize_base_url(url: str) -> str:
    """`HTTP://Host:8000/`, `http://host:8000/v1` -> `http://host:8000`; `http://h:80` -> `http://h`.

    Scheme and host are lower-cased and a default port dropped, so one replica written two ways is
    one replica. A path prefix is kept (a replica behind a path-routing proxy); a query string or
    fragment is refused, since the canary appends /v1/chat/completions and /metrics to the base URL.
    Credentials (user:password@) are kept for the requests and redacted wherever a URL is shown.
    """
    shown = redact_url(url)
    stripped = url.strip()
    if any(char.isspace() or ord(char) < 32 for char in stripped):
        raise ValueError(f"replica URL {shown!r} contains whitespace or control characters")
    try:
        parts = urlsplit(stripped)
        host, port = parts.hostname, parts.port
    except ValueError as error:
        raise ValueError(f"replica URL {shown!r} is malformed ({error}); write http://HOST:PORT") from None
    if parts.scheme.lower() not in _DEFAULT_PORTS or not host:
        raise ValueError(f"replica URL {shown!r} must look like http://HOST:PORT")
    if parts.query or parts.fragment or stripped.endswith(("?", "#")):
        raise ValueError(
            f"replica URL {shown!r} must not carry a query string or fragment: the canary appends "
            "/v1/chat/completions and /metrics to the base URL"
        )
    scheme = parts.scheme.lower()
    netloc = f"[{host}]" if ":" in host else host
    if port is not None and port != _DEFAULT_PORTS[scheme]:
        netloc += f":{port}"
    if parts.username is not None or parts.password is not None:
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@{netloc}"
    path = parts.path.rstrip("/").removesuffix("/v1").rstrip("/")
    return f"{scheme}://{netloc}{path}"


def printable(text: str) -> str:
    """`text` safe to print and serialize: a lone surrogate becomes its escape (display only)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _minus(later: int | None, earlier: int | None) -> int | None:
    return None if later is None or earlier is None else later - earlier


def _minus_all(later: dict[str, int], earlier: dict[str, int]) -> dict[str, int]:
    return {key: later.get(key, 0) - earlier.get(key, 0) for key in sorted(later.keys() | earlier.keys())}
