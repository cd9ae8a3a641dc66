"""HTTP primitives: one chat completion, one counter scrape. Used by the canary, the e2e tests, the operator.

Only a failed TCP connect is retried (the request never left, so a retry cannot double-send); a
timeout, a dropped connection, an error status or a malformed answer is reported as it is.

Deadlines: the TCP connect has its own (`connect_timeout`); once connected, the attempt has `timeout`
for the complete answer, not just per socket read. The overall asyncio deadline is their sum, so a
connect that never completes always ends as httpx's ConnectTimeout (unreachable, retried), never as
the overall deadline (a timeout after connecting, which is not retried).

Bodies are streamed and capped (`max_body_bytes`): the decoded size counts (a gzip bomb stops at the
cap, decompressed a bounded piece at a time), and a declared Content-Length over the cap is refused
before reading.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import zlib
from dataclasses import dataclass
from typing import Any

import httpx

from mooncake_operator.canary.defaults import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_MAX_CHAT_BODY_BYTES,
    DEFAULT_MAX_METRICS_BODY_BYTES,
)
from mooncake_operator.canary.divergence import LogprobsError, LogprobsUnusable, parse_logprobs
from mooncake_operator.canary.metrics import (
    COUNTER_NAMES,
    EXTERNAL_HITS,
    MetricsFormatError,
    ModelSeriesError,
    declares_store,
    has_vllm_metrics,
    parse_samples,
    select_model,
    store_counters,
)
from mooncake_operator.canary.models import (
    ChatAnswer,
    ErrorKind,
    SharedText,
    SpecDecoding,
    StoreCounters,
    printable,
    redact_url,
)

CHAT_PATH = "/v1/chat/completions"
METRICS_PATH = "/metrics"
_BODY_EXCERPT_CHARS = 500
# Decoded bytes produced per decompression step: bounds the memory of one step whatever the ratio.
_DECODE_STEP_BYTES = 64 * 1024


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
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
    max_body_bytes: int = DEFAULT_MAX_CHAT_BODY_BYTES,
    top_logprobs: int | None = None,
) -> ChatAnswer:
    """POST `request` (plus `cache_salt` when given) to the replica's chat endpoint; never raises for I/O.

    With `top_logprobs`, asks for per-token logprobs with that many alternatives and parses them
    strictly (bounded by the request's max_tokens); malformed logprobs make a MALFORMED answer.
    """
    body = dict(request)
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if top_logprobs is not None:
        # Tokens as ids (`token_id:N`, top lists too): two different characters whose byte-fallback
        # tokens both decode to U+FFFD are different ids.
        body["logprobs"] = True
        body["top_logprobs"] = top_logprobs
        body["return_tokens_as_token_ids"] = True
    exchange = await _exchange(
        client,
        "POST",
        base_url.rstrip("/") + CHAT_PATH,
        limits=_Limits(
            timeout, connect_timeout, max_body_bytes, "--max-chat-bytes, or spec.canary.maxChatBodyBytes"
        ),
        retry=retry,
        json=body,
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
        exchange.url,
        exchange.response,
        latency_s=exchange.latency_s,
        attempts=exchange.attempts,
        top_logprobs=top_logprobs,
        max_tokens=requested_max_tokens(request),
    )


DETOKENIZE_PATH = "/detokenize"
_DETOKENIZE_MAX_BODY_BYTES = 1024 * 1024


async def detokenize(
    client: httpx.AsyncClient,
    base_url: str,
    tokens: list[int],
    *,
    model: str | None,
    timeout: float,  # noqa: ASYNC109 - a deadline per attempt
    retry: RetryPolicy = NO_RETRY,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
) -> SharedText:
    """The text of `tokens` as the replica decodes them (vLLM's `POST /detokenize`); never raises for I/O:
    a failure is in `SharedText.error`, with the URL redacted."""
    body: dict[str, Any] = {"tokens": tokens}
    if model is not None:
        body["model"] = model
    exchange = await _exchange(
        client,
        "POST",
        base_url.rstrip("/") + DETOKENIZE_PATH,
        limits=_Limits(timeout, connect_timeout, _DETOKENIZE_MAX_BODY_BYTES, "(fixed cap)"),
        retry=retry,
        json=body,
    )
    response = exchange.response
    timed = {"tokens": len(tokens), "latency_s": exchange.latency_s}
    if response is None:
        return SharedText(**timed, error=exchange.error)
    if response.status_code != 200:
        return SharedText(**timed, error=_status_message("POST", exchange.url, response))
    try:
        payload = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        payload = None
    text = payload.get("prompt") if isinstance(payload, dict) else None
    if not isinstance(text, str) or not _valid_unicode(text):
        return SharedText(
            **timed,
            error=f"POST {exchange.url} answered 200 without the decoded text ('prompt'): "
            f"{_body_excerpt(response)[:200]!r}",
        )
    return SharedText(**timed, text=text)


def requested_max_tokens(request: dict[str, Any]) -> int | None:
    """The answer tokens a request allows (max_completion_tokens, else max_tokens); None: unbounded."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = request.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


async def scrape_counters(
    client: httpx.AsyncClient,
    base_url: str,
    *,
    timeout: float,  # noqa: ASYNC109 - a deadline per attempt; retries must not share one
    retry: RetryPolicy = NO_RETRY,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
    max_body_bytes: int = DEFAULT_MAX_METRICS_BODY_BYTES,
    model: str | None = None,
) -> StoreCounters:
    """The replica's cache, store and spec-decode counters of `model` (None: the page's only model);
    raises CounterScrapeError with a clear message."""
    exchange = await _exchange(
        client,
        "GET",
        base_url.rstrip("/") + METRICS_PATH,
        limits=_Limits(
            timeout,
            connect_timeout,
            max_body_bytes,
            "--max-metrics-bytes, or spec.canary.maxMetricsBodyBytes",
        ),
        retry=retry,
        headers={"Accept": "text/plain"},
    )
    response = exchange.response
    if response is None:
        assert exchange.error_kind is not None and exchange.error is not None
        raise CounterScrapeError(exchange.error_kind, exchange.error, latency_s=exchange.latency_s)
    return parse_metrics_response(exchange.url, response, latency_s=exchange.latency_s, model=model)


def parse_chat_response(
    url: str,
    response: httpx.Response,
    *,
    latency_s: float,
    attempts: int,
    top_logprobs: int | None = None,
    max_tokens: int | None = None,
) -> ChatAnswer:
    """A chat completion from an HTTP response, or a ChatAnswer that says precisely what is wrong.

    With `top_logprobs` (they were asked for), `choices[0].logprobs` is parsed strictly
    (`parse_logprobs`); without, it is ignored. `content` may be null beside a reasoning text (a
    reasoning model whose budget ended inside its reasoning, or that stopped right after it); vLLM names
    that field `reasoning` (older releases `reasoning_content`). `usage` and `metrics` are read strictly:
    a count of the wrong type or an impossible one (cached tokens beyond the prompt, more drafts accepted
    than proposed) is malformed; an absent one is no evidence."""
    base = {"url": url, "status": response.status_code, "latency_s": latency_s, "attempts": attempts}
    excerpt = _body_excerpt(response)
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
    if not isinstance(message, dict):
        return _malformed(base, excerpt, f"POST {url} answered 200 but choices[0].message is not an object")
    content = message.get("content")
    reasoning = _reasoning(message)
    if not isinstance(content, str) and not (content is None and reasoning is not None):
        return _malformed(
            base, excerpt, f"POST {url} answered 200 but choices[0].message.content is not text"
        )
    if (content is not None and not _valid_unicode(content)) or (
        reasoning is not None and not _valid_unicode(reasoning)
    ):
        return _malformed(
            base,
            excerpt,
            f"POST {url} answered 200 but the answer is not valid Unicode text (a lone surrogate escape)",
        )
    try:
        usage = _usage(payload.get("usage"), max_tokens)
        spec_decoding = _spec_decoding(payload.get("metrics"), usage.completion_tokens)
    except _Malformed as error:
        return _malformed(base, excerpt, f"POST {url} answered 200 with impossible {error}")
    logprobs = logprobs_problem = None
    if top_logprobs is not None:
        try:
            logprobs = parse_logprobs(choices[0].get("logprobs"), top_k=top_logprobs, max_entries=max_tokens)
        except LogprobsError as error:
            return _malformed(base, excerpt, f"POST {url} answered 200 with impossible logprobs: {error}")
        except LogprobsUnusable as error:
            logprobs_problem = str(error)
    model = payload.get("model")
    return ChatAnswer(
        **base,
        text=content,
        model=printable(model) if isinstance(model, str) else None,
        reasoning=reasoning,
        finish_reason=_text_or_none(choices[0].get("finish_reason")),
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
        spec_decoding=spec_decoding,
        logprobs=logprobs,
        logprobs_problem=logprobs_problem,
    )


class _Malformed(ValueError):
    """A field of a 200 answer that no vLLM server sends."""


@dataclass(frozen=True)
class _Usage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


# No prompt or answer is longer: bounds what a count may claim (a context of 2**31 tokens is absurd).
_MAX_COUNT = 2**31


def _usage(raw: object, max_tokens: int | None) -> _Usage:
    """`usage` strictly: counts are integers in range, cached tokens within the prompt, the answer within
    the tokens asked for. Absent fields (or `usage` itself) are None: no evidence, never zero."""
    if raw is None:
        return _Usage()
    if not isinstance(raw, dict):
        raise _Malformed(f"usage: {type(raw).__name__}, not an object")
    prompt = _count(raw.get("prompt_tokens"), "usage.prompt_tokens")
    completion = _count(raw.get("completion_tokens"), "usage.completion_tokens")
    if completion is not None and max_tokens is not None and completion > max_tokens:
        raise _Malformed(f"usage.completion_tokens {completion}, more than the {max_tokens} asked for")
    details = raw.get("prompt_tokens_details")
    if details is not None and not isinstance(details, dict):
        raise _Malformed(f"usage.prompt_tokens_details: {type(details).__name__}, not an object")
    cached = (
        _count(details.get("cached_tokens"), "usage.prompt_tokens_details.cached_tokens") if details else None
    )
    if cached is not None and (prompt is None or cached > prompt):
        raise _Malformed(
            f"usage.prompt_tokens_details.cached_tokens {cached}, more than the prompt's {prompt} tokens"
        )
    return _Usage(prompt, completion, cached)


_SPEC_COUNTS = ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens", "num_spec_tokens")
# vLLM's num_speculative_tokens is a handful; a per-request histogram is that long plus one.
_MAX_SPEC_TOKENS = 1024


def _spec_decoding(raw: object, completion_tokens: int | None) -> SpecDecoding | None:
    """`metrics.speculative_decoding` (vLLM's SpeculativeDecodingMetrics) strictly: counts in range and
    consistent with its own acceptance histogram, no more verify steps than answer tokens."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise _Malformed(f"metrics: {type(raw).__name__}, not an object")
    spec = raw.get("speculative_decoding")
    if spec is None:
        return None
    where = "metrics.speculative_decoding"
    if not isinstance(spec, dict):
        raise _Malformed(f"{where}: {type(spec).__name__}, not an object")
    counts = {name: _count(spec.get(name), f"{where}.{name}") for name in _SPEC_COUNTS}
    missing = [name for name, value in counts.items() if value is None]
    if missing:
        raise _Malformed(f"{where}: no {', '.join(missing)}")
    steps, drafted, accepted, width = (int(counts[name] or 0) for name in _SPEC_COUNTS)
    histogram = spec.get("acceptance_histogram")
    if (
        not isinstance(histogram, list)
        or width > _MAX_SPEC_TOKENS
        or len(histogram) != width + 1
        or any(_count(item, f"{where}.acceptance_histogram") is None for item in histogram)
    ):
        raise _Malformed(f"{where}.acceptance_histogram: not {width + 1} counts (num_spec_tokens + 1)")
    problems = []
    if sum(histogram) != steps:
        problems.append(f"the histogram counts {sum(histogram)} steps, num_spec_steps says {steps}")
    if sum(j * count for j, count in enumerate(histogram)) != accepted:
        problems.append("the histogram disagrees with num_accepted_draft_tokens")
    if accepted > drafted or drafted > steps * width:
        problems.append(f"{accepted} accepted of {drafted} drafted over {steps} steps of {width}")
    if completion_tokens is not None and steps > completion_tokens:
        problems.append(f"{steps} verify steps for {completion_tokens} answer tokens")
    for name in ("mean_acceptance_length", "draft_acceptance_rate"):
        value = spec.get(name)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            problems.append(f"{name} is {value!r}, not a finite number >= 0")
    if problems:
        raise _Malformed(f"{where}: {'; '.join(problems)}")
    return SpecDecoding(
        num_spec_steps=steps,
        num_draft_tokens=drafted,
        num_accepted_draft_tokens=accepted,
        num_spec_tokens=width,
    )


def _count(value: object, where: str) -> int | None:
    """A token count: None when absent; an integer 0 <= n < 2**31, else malformed."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_COUNT:
        raise _Malformed(f"{where}: {value!r}, not a count")
    return value


def _reasoning(message: dict[str, Any]) -> str | None:
    """The reasoning text: vLLM 0.32's `reasoning`, or `reasoning_content` of older releases."""
    for key in ("reasoning", "reasoning_content"):
        value = message.get(key)
        if isinstance(value, str):
            return value
    return None


def parse_metrics_response(
    url: str, response: httpx.Response, *, latency_s: float, model: str | None = None
) -> StoreCounters:
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
    if any(sample.name == EXTERNAL_HITS for sample in samples):
        try:
            samples = select_model(samples, model)
        except ModelSeriesError as error:
            message = f"GET {url}: {error}"
            raise CounterScrapeError(ErrorKind.MALFORMED, message, latency_s=latency_s) from None
    counters = store_counters(samples, latency_s=latency_s, store_metrics_declared=declares_store(text))
    if counters.external_hit_tokens is None:
        raise CounterScrapeError(
            ErrorKind.MALFORMED,
            f"GET {url} has no {EXTERNAL_HITS}: the warm path cannot be proven "
            "(vLLM V1 registers it at start-up; an older engine or a filtered metrics page?)",
            latency_s=latency_s,
        )
    return counters


@dataclass(frozen=True)
class _Limits:
    timeout_s: float
    connect_timeout_s: float
    max_body_bytes: int
    flag: str  # the option that raises the cap, named in the error


class _TooLarge(Exception):
    pass


class _BadEncoding(Exception):
    pass


async def _exchange(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    limits: _Limits,
    retry: RetryPolicy,
    **kwargs: Any,
) -> _Exchange:
    shown = redact_url(url)
    timeouts = httpx.Timeout(limits.timeout_s, connect=limits.connect_timeout_s)
    # Ask for an uncompressed body; a server that compresses anyway is decoded within the cap.
    headers = {"Accept-Encoding": "identity", **kwargs.pop("headers", {})}
    attempt = 0
    while True:
        attempt += 1
        started = time.perf_counter()

        try:
            async with asyncio.timeout(limits.connect_timeout_s + limits.timeout_s):
                request = client.build_request(method, url, timeout=timeouts, headers=headers, **kwargs)
                response = await client.send(request, stream=True)
                try:
                    body = await _read_capped(response, limits.max_body_bytes)
                finally:
                    await response.aclose()
            return _Exchange(shown, attempt, time.perf_counter() - started, response=_decoded(response, body))
        except (httpx.ConnectError, httpx.ConnectTimeout) as error:
            if attempt > retry.retries:
                return _failed(
                    shown,
                    attempt,
                    started,
                    ErrorKind.CONNECTION,
                    f"cannot connect to {shown} ({attempt} attempts): {_describe(error)}",
                )
        except (TimeoutError, httpx.TimeoutException):
            return _failed(
                shown,
                attempt,
                started,
                ErrorKind.TIMEOUT,
                f"{method} {shown}: no complete answer within {limits.timeout_s:g} s",
            )
        except _TooLarge:
            return _failed(
                shown,
                attempt,
                started,
                ErrorKind.TOO_LARGE,
                f"{method} {shown}: the body is larger than the {limits.max_body_bytes}-byte cap "
                f"(decoded size; raise it with {limits.flag} if the replica is right)",
            )
        except _BadEncoding as error:
            return _failed(shown, attempt, started, ErrorKind.MALFORMED, f"{method} {shown}: {error}")
        except httpx.TransportError as error:
            return _failed(
                shown,
                attempt,
                started,
                ErrorKind.DISCONNECTED,
                f"{method} {shown}: the connection broke before a complete answer: {_describe(error)}",
            )
        await asyncio.sleep(retry.delay_s(attempt))


def _failed(url: str, attempt: int, started: float, kind: ErrorKind, message: str) -> _Exchange:
    return _Exchange(url, attempt, time.perf_counter() - started, error_kind=kind, error=message)


async def _read_capped(response: httpx.Response, cap: int) -> bytes:
    """The decoded body, or _TooLarge as soon as it (or its declared length) passes `cap` bytes."""
    try:
        ready = response.content  # already in memory (an injected transport's response): decoded by httpx
    except httpx.ResponseNotRead:
        pass
    else:
        if len(ready) > cap:
            raise _TooLarge
        return ready
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        raise _TooLarge
    decoder = _decoder(response.headers.get("content-encoding", ""))
    # Pieces joined once at the end: the body is copied once (a growing bytearray is copied as it grows,
    # then once more into bytes).
    pieces: list[bytes] = []
    size = 0
    async for raw in response.aiter_raw():
        if decoder is None:
            pieces.append(raw)
            size += len(raw)
        else:
            pending = raw
            while pending:
                # max_length bounds what one step may produce; the rest waits in unconsumed_tail.
                try:
                    piece = decoder.decompress(pending, min(_DECODE_STEP_BYTES, cap + 1 - size))
                except zlib.error as error:
                    raise _BadEncoding(f"the compressed body is corrupt: {error}") from None
                pieces.append(piece)
                size += len(piece)
                pending = decoder.unconsumed_tail
                if size > cap:
                    raise _TooLarge
        if size > cap:
            raise _TooLarge
    return b"".join(pieces)


def _decoder(encoding: str) -> Any:
    """A zlib decompressor for gzip/deflate; None for identity; _BadEncoding for anything else."""
    encodings = [part.strip().lower() for part in encoding.split(",") if part.strip()]
    if not encodings or encodings == ["identity"]:
        return None
    if encodings == ["gzip"] or encodings == ["x-gzip"]:
        return zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    if encodings == ["deflate"]:
        return zlib.decompressobj()
    raise _BadEncoding(f"unsupported Content-Encoding {encoding!r} (the canary asks for identity)")


def _decoded(response: httpx.Response, body: bytes) -> httpx.Response:
    """A complete response holding the decoded body (the encoding headers no longer apply)."""
    try:
        if response.content is body:
            return response  # read before we saw it (an injected transport): already decoded
    except httpx.ResponseNotRead:
        pass
    headers = [
        (name, value)
        for name, value in response.headers.multi_items()
        if name.lower() not in ("content-encoding", "content-length", "transfer-encoding")
    ]
    return httpx.Response(response.status_code, headers=headers, content=body, request=response.request)


def _status_message(method: str, url: str, response: httpx.Response) -> str:
    detail = printable(_error_detail(response))
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


def _body_excerpt(response: httpx.Response) -> str:
    """The body's first characters, decoded from its first bytes only: `response.text` would hold a
    second, decoded copy of the whole body (up to 4 bytes a character) for as long as the response."""
    head = response.content[: _BODY_EXCERPT_CHARS * 4].decode(response.encoding or "utf-8", errors="replace")
    return printable(head[:_BODY_EXCERPT_CHARS])


def _malformed(base: dict[str, Any], excerpt: str, message: str) -> ChatAnswer:
    return ChatAnswer(**base, error_kind=ErrorKind.MALFORMED, error=message, body_excerpt=excerpt)


def _describe(error: Exception) -> str:
    return str(error) or type(error).__name__


def _text_or_none(value: object) -> str | None:
    return printable(value) if isinstance(value, str) else None


def _valid_unicode(text: str) -> bool:
    """False for a string holding a lone surrogate (JSON's "\\ud800" escape decodes to one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
