"""Warm/cold canary: proof that an answer computed from a prefix loaded from the store equals the cold one.

Depends on httpx and pydantic only; nothing of Kubernetes, so it runs against any vLLM replicas.
"""

from mooncake_operator.canary.client import (
    CounterScrapeError,
    RetryPolicy,
    chat,
    parse_chat_response,
    scrape_counters,
)
from mooncake_operator.canary.expectations import (
    Contains,
    Expectation,
    JsonFieldEquals,
    JsonObjectOnly,
    JsonValuesExclude,
    JsonValuesInclude,
    NotContains,
    violations,
)
from mooncake_operator.canary.metrics import expected_external_hit_tokens, parse_samples, store_counters
from mooncake_operator.canary.models import (
    CanaryConfig,
    CanaryResult,
    ChatAnswer,
    ErrorKind,
    ExitCode,
    Mismatch,
    PairResult,
    StoreCounters,
    Verdict,
)
from mooncake_operator.canary.report import render_json, render_table
from mooncake_operator.canary.request import customer_expectations, customer_request
from mooncake_operator.canary.runner import judge_pair, plan_pairs, run_canary
from mooncake_operator.canary_defaults import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_MAX_CHAT_BODY_BYTES,
    DEFAULT_MAX_METRICS_BODY_BYTES,
)

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_MAX_CHAT_BODY_BYTES",
    "DEFAULT_MAX_METRICS_BODY_BYTES",
    "CanaryConfig",
    "CanaryResult",
    "ChatAnswer",
    "Contains",
    "CounterScrapeError",
    "ErrorKind",
    "ExitCode",
    "Expectation",
    "JsonFieldEquals",
    "JsonObjectOnly",
    "JsonValuesExclude",
    "JsonValuesInclude",
    "Mismatch",
    "NotContains",
    "PairResult",
    "RetryPolicy",
    "StoreCounters",
    "Verdict",
    "chat",
    "customer_expectations",
    "customer_request",
    "expected_external_hit_tokens",
    "judge_pair",
    "parse_chat_response",
    "parse_samples",
    "plan_pairs",
    "render_json",
    "render_table",
    "run_canary",
    "scrape_counters",
    "store_counters",
    "violations",
]
