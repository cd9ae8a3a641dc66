"""HTTP primitives: one chat completion, one counter scrape. Used by the canary, the e2e tests, the operator.

Only a failed TCP connect is retried (the request never left, so a retry cannot double-send); a
timeout, a dropped connection, an error status or a malformed answer is reported as it is. Each
attempt gets the whole timeout as a deadline for the complete answer, not just per socket read.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from mooncake_operator.canary.metrics import (
    COUNTER_NAMES,
    EXTERNAL_HITS,
    MetricsFormatError,
    has_vllm_metrics,
    parse_samples,
    store_counters,
)
from mooncake_operator.canary.models import ChatAnswer, ErrorKind, StoreCounters

CHAT_PATH = "/v1/chat/completions"
METRICS_PATH = "/metrics"
_BODY_EXCERPT_CHARS = 500


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff for connection failures: delays backoff_s, 2*backoff_s, ... <= cap."""

    retries: int = 0
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0

    def delay_s(self, attempt: int) -> float:
        """Pause after the failed attempt number `attempt` (1-based)."""
        return float(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))


NO_RETRY = RetryPolicy()


class CounterScrapeError(Exception):
    """The counters could not be read; `kind` says whether the replica was unreachable or answered wrongly."""

    def __init__(self, kind: ErrorKind, message: str, *, latency_s: float = 0.0) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.latency_s = latency_s


@dataclass(frozen=True)
class _Exchange:
    """The outcome of sending one request, retries included: a response, or why there is none."""

    url: str
    attempts: int
    latency_s: float
    response: httpx.Response | None = None
    error_kind: ErrorKind | None = None
    error: str | None = None


async def chat(
    client: httpx.AsyncClient,
    base_url: str,
    request: dict[str, Any],
    *,
    cache_salt: str | None,
    timeout: float,  # noqa: ASYNC109 - a deadline per attempt; retries must not share one
    retry: RetryPolicy = NO_RETRY,
) -> ChatAnswer:
    """POST `request` (plus `cache_salt` when given) to the replica's chat endpoint; never raises for I/O."""
    body = dict(request)
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    exchange = await _exchange(
        client, "POST", base_url.rstrip("/") + CHAT_PATH, timeout=timeout, retry=retry, json=body
    )
    if exchange.response is None:
        return ChatAnswer(
            url=exchange.url,
            latency_s=exchange.latency_s,
            attempts=exchange.attempts,
            error_kind=exchange.error_kind,
            error=exchange.error,
        )
    return parse_chat_response(
        exchange.url, exchange.response, latency_s=exchange.latency_s, attempts=exchange.attempts
    )


async def scrape_counters(
    client: httpx.AsyncClient,
    base_url: str,
    *,
    timeout: float,  # noqa: ASYNC109 - a deadline per attempt; retries must not share one
    retry: RetryPolicy = NO_RETRY,
) -> StoreCounters:
    """The replica's cache and store counters; raises CounterScrapeError with a clear message."""
    exchange = await _exchange(
        client,
        "GET",
        base_url.rstrip("/") + METRICS_PATH,
        timeout=timeout,
        retry=retry,
        headers={"Accept": "text/plain"},
    )
    response = exchange.response
    if response is None:
        assert exchange.error_kind is not None and exchange.error is not None
        raise CounterScrapeError(exchange.error_kind, exchange.error, latency_s=exchange.latency_s)
    return parse_metrics_response(exchange.url, response, latency_s=exchange.latency_s)


def parse_chat_response(url: str, response: httpx.Response, *, latency_s: float, attempts: int) -> ChatAnswer:
    """A chat completion from an HTTP response, or a ChatAnswer that says precisely what is wrong."""
    base = {"url": url, "status": response.status_code, "latency_s": latency_s, "attempts": attempts}
    excerpt = response.text[:_BODY_EXCERPT_CHARS]
    if response.status_code != 200:
        return ChatAnswer(
            **base,
            error_kind=ErrorKind.HTTP_STATUS,
            error=_status_message("POST", url, response),
            body_excerpt=excerpt,
        )
    try:
        payload = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _malformed(
            base,
            excerpt,
            f"POST {url} answered 200 with a body that is not JSON "
            f"(content-type {response.headers.get('content-type', 'none')!r}); "
            "not a vLLM OpenAI-compatible server?",
        )
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return _malformed(base, excerpt, f"POST {url} answered 200 without 'choices': not a chat completion")
    message = choices[0].get("message")
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str):
        return _malformed(
            base, excerpt, f"POST {url} answered 200 but choices[0].message.content is not text"
        )
    assert isinstance(message, dict)
    usage = payload.get("usage") if isinstance(payload.get("usage"), dict) else {}
    details = usage.get("prompt_tokens_details")
    return ChatAnswer(
        **base,
        text=content,
        reasoning=_text_or_none(message.get("reasoning_content", message.get("reasoning"))),
        finish_reason=_text_or_none(choices[0].get("finish_reason")),
        prompt_tokens=_int_or_none(usage.get("prompt_tokens")),
        completion_tokens=_int_or_none(usage.get("completion_tokens")),
        cached_tokens=_int_or_none(details.get("cached_tokens")) if isinstance(details, dict) else None,
    )


def parse_metrics_response(url: str, response: httpx.Response, *, latency_s: float) -> StoreCounters:
    if response.status_code != 200:
        hint = " (no metrics endpoint: is this a vLLM server?)" if response.status_code == 404 else ""
        raise CounterScrapeError(
            ErrorKind.HTTP_STATUS, _status_message("GET", url, response) + hint, latency_s=latency_s
        )
    text = response.text
    if not has_vllm_metrics(text):
        raise CounterScrapeError(
            ErrorKind.MALFORMED,
            f"GET {url} has no vllm:* metrics: not a vLLM server's metrics page",
            latency_s=latency_s,
        )
    try:
        samples = parse_samples(text, only=COUNTER_NAMES)
    except MetricsFormatError as error:
        raise CounterScrapeError(
            ErrorKind.MALFORMED, f"GET {url} is not Prometheus text: {error}", latency_s=latency_s
        ) from None
    counters = store_counters(samples, latency_s=latency_s)
    if counters.external_hit_tokens is None:
        raise CounterScrapeError(
            ErrorKind.MALFORMED,
            f"GET {url} has no {EXTERNAL_HITS}: the warm path cannot be proven "
            "(vLLM V1 registers it at start-up; an older engine or a filtered metrics page?)",
            latency_s=latency_s,
        )
    return counters


async def _exchange(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    timeout: float,  # noqa: ASYNC109 - a deadline per attempt; retries must not share one
    retry: RetryPolicy,
    **kwargs: Any,
) -> _Exchange:
    attempt = 0
    while True:
        attempt += 1
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout):
                response = await client.request(method, url, timeout=timeout, **kwargs)
                await response.aread()
            return _Exchange(url, attempt, time.perf_counter() - started, response=response)
        except (httpx.ConnectError, httpx.ConnectTimeout) as error:
            if attempt > retry.retries:
                return _Exchange(
                    url,
                    attempt,
                    time.perf_counter() - started,
                    error_kind=ErrorKind.CONNECTION,
                    error=f"cannot connect to {url} ({attempt} attempts): {_describe(error)}",
                )
        except (TimeoutError, httpx.TimeoutException):
            return _Exchange(
                url,
                attempt,
                time.perf_counter() - started,
                error_kind=ErrorKind.TIMEOUT,
                error=f"{method} {url}: no complete answer within {timeout:g} s",
            )
        except httpx.TransportError as error:
            return _Exchange(
                url,
                attempt,
                time.perf_counter() - started,
                error_kind=ErrorKind.DISCONNECTED,
                error=f"{method} {url}: the connection broke before a complete answer: {_describe(error)}",
            )
        await asyncio.sleep(retry.delay_s(attempt))


def _status_message(method: str, url: str, response: httpx.Response) -> str:
    detail = _error_detail(response)
    message = f"{method} {url} returned HTTP {response.status_code}"
    if detail:
        message += f": {detail}"
    if response.status_code in (404, 405) and method == "POST":
        message += " (is this a vLLM OpenAI-compatible server, serving the request's model?)"
    return message


def _error_detail(response: httpx.Response) -> str:
    """vLLM's {"error": {"message": ...}}, the older flat {"message": ...}, FastAPI's {"detail": ...};
    else a text excerpt."""
    try:
        payload = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return " ".join(response.text[:200].split())
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        for key in ("message", "detail"):
            if isinstance(payload.get(key), str):
                return str(payload[key])
    return " ".join(response.text[:200].split())


def _malformed(base: dict[str, Any], excerpt: str, message: str) -> ChatAnswer:
    return ChatAnswer(**base, error_kind=ErrorKind.MALFORMED, error=message, body_excerpt=excerpt)


def _describe(error: Exception) -> str:
    return str(error) or type(error).__name__


def _text_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
