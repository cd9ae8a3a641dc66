"""Fake vLLM replicas on loopback that share a fake Mooncake store, for canary and operator tests.

Each replica is a real HTTP server (stdlib, one thread per connection) on 127.0.0.1 and a random
port, speaking the parts of vLLM's OpenAI server the product touches: `POST /v1/chat/completions`,
`POST /tokenize`, `POST /detokenize`, `GET /metrics` (Prometheus text with vLLM's metric names and
labels, rendered by prometheus_client), `GET /health` and `GET /v1/models`. Behind them:

- a word-level "tokenizer" with a chat template, so prompts have a token count;
- a vocabulary of token ids for answers: ASCII words and punctuation are one token each, other
  characters UTF-8 byte-fallback tokens (one per byte, each decoding to U+FFFD alone), `<think>` and
  `</think>` special tokens; answers carry logprobs by token id (`token_id:N`) as vLLM 0.32 sends them;
- block hashes chained from the first block, with `cache_salt` mixed into the first (as vLLM does);
- a per-replica local prefix cache and a store shared by the cluster, keyed by block hash, whose puts
  can lag (`put_delay_s`, a sending thread), never arrive or fail (`puts`);
- vLLM 0.32's hit arithmetic: local hits stop one token short of the prompt, the store lookup
  walks the prompt's full blocks, Eagle drops the last hit block;
- per-request evidence (`usage.prompt_tokens_details.cached_tokens`, `metrics.speculative_decoding`)
  and the counters a real replica shows: external hits/queries, local hits, prompt tokens (total and by
  source), finished requests, running/waiting requests, Mooncake `load_get`/`save_put`/`save_exists`/
  `lookup_exists` keys and failed keys, Eagle's draft counters;
- optional reasoning (`reasoning`: "parser" splits it as vLLM's reasoning parser does, "raw" leaves
  `…</think>\\n\\n{json}` in the content), truncation at `max_tokens` (finish_reason "length");
- optional other users' traffic (`other_traffic`) counted beside each request, like concurrent users.

A replica's `mode` (settable while it runs) decides how it misbehaves. Corruption modes corrupt
only answers computed from a prefix loaded from the store, like the customer's bug; the error
modes apply to every request of their kind. Subclasses change what a loaded answer looks like by
overriding `shape_tokens` / `shape_payload` (tests/support/adversarial_replicas.py).

    with FakeCluster.start(2, modes=[Mode.CORRECT, Mode.US_EAST]) as cluster:
        cluster.urls            # ["http://127.0.0.1:PORT", ...]
        cluster[1].mode = Mode.CORRECT
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from enum import StrEnum
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

import prometheus_client

from mooncake_operator.canary.request import reference_request

DEFAULT_MODEL = "MiniMaxAI/MiniMax-M2.5"
CORRECT_ANSWER = '{"region": "us-west", "replica_count": 4, "max_batch_size": 16}'
PARAPHRASE = "I keep the deployment record and answer only from its latest values."
# What a reasoning replica thinks before it answers: it names the superseded values, which the content
# checks must not see (they judge the answer after the reasoning).
REASONING = (
    "The first record said the region is us-east, the replica count is 2 and the maximum batch size is 8. "
    "The production update supersedes all three of them, so I must answer with the latest values only, "
    "as one JSON object and nothing else."
)
THINK_START, THINK_END = "<think>", "</think>"
# Eagle's drafts per verify step (num_speculative_tokens).
SPEC_TOKENS = 3

_TOKEN = re.compile(r"\w+|[^\w\s]")
_HANG_LIMIT_S = 60.0


class Mode(StrEnum):
    CORRECT = "correct"
    # Corruptions the customer saw, on answers computed from a loaded prefix only.
    US_EAST = "us_east"  # us-east from the initial rollout mixed into the updated values
    OLD_BATCH_SIZE = "old_batch_size"  # the superseded batch size 8 kept
    OMIT_FIELD = "omit_field"  # an updated field left out
    PARAPHRASE = "paraphrase"  # a paraphrase of the system instruction before the JSON object
    # The bug's full signature: the connector loads one block less than the scheduler counted.
    DOUBLE_PRUNE = "double_prune"
    NEVER_LOADS = "never_loads"  # the store lookup always misses (e.g. no connector): answers stay right
    IGNORES_SALT = "ignores_salt"  # cache_salt is not mixed into block hashes
    # Every store load fails; kv_load_failure_policy recompute: the answer is recomputed (right), the hit
    # and the cached tokens are counted anyway (at scheduling), the failed load_get keys too.
    LOAD_FAILS_RECOMPUTE = "load_fails_recompute"
    HTTP_500 = "http_500"  # every chat request answers 500
    HANG = "hang"  # every chat request hangs until the cluster stops
    NOT_VLLM = "not_vllm"  # some other web server: HTML on /, 404 everywhere else
    NON_JSON = "non_json"  # chat answers 200 with a plain-text body
    NO_CHOICES = "no_choices"  # chat answers 200 with JSON lacking "choices"
    NO_METRICS = "no_metrics"  # /metrics answers 404
    METRICS_WITHOUT_COUNTERS = "metrics_without_counters"  # /metrics lacks the cache counters


_CORRUPTED_ANSWERS = {
    Mode.US_EAST: '{"region": "us-east", "replica_count": 4, "max_batch_size": 16}',
    Mode.OLD_BATCH_SIZE: '{"region": "us-west", "replica_count": 4, "max_batch_size": 8}',
    Mode.OMIT_FIELD: '{"region": "us-west", "replica_count": 4}',
    Mode.PARAPHRASE: f"{PARAPHRASE}\n{CORRECT_ANSWER}",
    Mode.DOUBLE_PRUNE: '{"region": "us-east", "replica_count": 4, "max_batch_size": 8}',
}


def tokenize(messages: Sequence[dict[str, Any]]) -> list[str]:
    """Words and punctuation of the prompt rendered with a ChatML-like template."""
    rendered = "".join(f"<|im_start|>{m.get('role')}\n{m.get('content')}<|im_end|>\n" for m in messages)
    return _TOKEN.findall(rendered + "<|im_start|>assistant\n")


def block_hashes(tokens: Sequence[str], block_size: int, salt: str | None) -> list[str]:
    """One hash per full block, each chained to the previous; the salt enters the first (vLLM's rule)."""
    hashes: list[str] = []
    parent = salt or ""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        digest = hashlib.sha256(json.dumps([parent, tokens[start : start + block_size]]).encode())
        parent = digest.hexdigest()
        hashes.append(parent)
    return hashes


def answer_for(messages: Sequence[dict[str, Any]]) -> str:
    """The correct (cold) answer: the customer's JSON for the customer's question (also after the default
    suite's padding turn), else a stable digest."""
    if messages and messages[-1] == reference_request()["messages"][-1]:
        return CORRECT_ANSWER
    digest = hashlib.sha256(json.dumps(list(messages), sort_keys=True).encode()).hexdigest()
    return f"Deterministic answer {digest[:16]}."


# --- token ids ---------------------------------------------------------------------------------------


class Vocabulary:
    """Token ids for answers, shared by every replica (one tokenizer): special tokens, 256 byte-fallback
    tokens, then each ASCII piece in the order first seen."""

    _SPECIAL = (THINK_START, THINK_END)
    _BYTES_FROM = 10
    _WORDS_FROM = 1000
    _PIECE = re.compile(r"<think>|</think>|\s*(?:\w+|[^\w\s])|\s+")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: dict[str, int] = {}
        self._pieces: dict[int, bytes] = {}
        for index, special in enumerate(self._SPECIAL):
            self._pieces[index + 1] = special.encode()
            self._ids[special] = index + 1

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._PIECE.findall(text):
            if piece in self._SPECIAL or piece.isascii():
                ids.append(self.word(piece))
            else:  # byte fallback: one token per UTF-8 byte
                ids.extend(self._BYTES_FROM + byte for byte in piece.encode())
        return ids

    def word(self, piece: str) -> int:
        with self._lock:
            if piece not in self._ids:
                token_id = self._WORDS_FROM + len(self._ids)
                self._ids[piece] = token_id
                self._pieces[token_id] = piece.encode()
            return self._ids[piece]

    def bytes_of(self, token_id: int) -> bytes:
        if self._BYTES_FROM <= token_id < self._BYTES_FROM + 256:
            return bytes([token_id - self._BYTES_FROM])
        with self._lock:
            return self._pieces.get(token_id, b"")

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.bytes_of(token_id) for token_id in ids).decode("utf-8", "replace")

    def text(self, token_id: int) -> str:
        """One token on its own, as vLLM decodes it (a lone byte-fallback token is U+FFFD)."""
        return self.decode([token_id])


VOCAB = Vocabulary()
_ALTERNATIVES = 19  # enough for any top_logprobs vLLM serves by default (20)
_ALTERNATIVE_IDS = [VOCAB.word(f"<alt{rank}>") for rank in range(_ALTERNATIVES)]


@dataclass(frozen=True)
class Token:
    """One generated token: its id, its logprob, and the top list (sampled token first, then the
    alternatives by rank, as vLLM lists them)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]

    def shifted(self, nats: float, *, top_too: bool = True) -> Token:
        """Every logprob `nats` lower (a flattened distribution); clamped at 0 from above."""
        top = tuple((i, min(0.0, lp - nats)) for i, lp in self.top) if top_too else self.top
        return replace(self, logprob=min(0.0, self.logprob - nats), top=top)


def healthy_token(token_id: int, *, alternative_gap: float = 2.0) -> Token:
    """A confident token: its logprob a stable function of the id (-0.01..-0.05), alternatives
    `alternative_gap` nat below it and lower."""
    logprob = -0.01 * (1 + int(hashlib.sha256(str(token_id).encode()).hexdigest(), 16) % 5)
    alternatives = tuple((alt, logprob - alternative_gap - rank) for rank, alt in enumerate(_ALTERNATIVE_IDS))
    return Token(token_id, logprob, ((token_id, logprob), *alternatives))


def tokens_for(text: str) -> list[Token]:
    return [healthy_token(token_id) for token_id in VOCAB.encode(text)]


def logprobs_payload(tokens: Sequence[Token], top_logprobs: int, *, as_ids: bool = True) -> dict[str, Any]:
    """OpenAI `choices[0].logprobs` for `tokens`, as vLLM 0.32 sends them: tokens as `token_id:N` with
    `return_tokens_as_token_ids`, else as text."""

    def name(token_id: int) -> str:
        return f"token_id:{token_id}" if as_ids else VOCAB.text(token_id)

    content = []
    for token in tokens:
        top = [
            {"token": name(i), "logprob": lp, "bytes": list(name(i).encode())}
            for i, lp in token.top[:top_logprobs]
        ]
        own = VOCAB.text(token.token_id)
        content.append(
            {
                "token": name(token.token_id),
                "logprob": token.logprob,
                "bytes": list(own.encode()),
                "top_logprobs": top,
            }
        )
    return {"content": content}


def answer_logprobs(answer: str, top_logprobs: int) -> dict[str, Any]:
    """`choices[0].logprobs` of a healthy answer `answer`, by token id."""
    return logprobs_payload(tokens_for(answer), top_logprobs)


def corrupt(mode: Mode, answer: str) -> str:
    if answer == CORRECT_ANSWER:
        return _CORRUPTED_ANSWERS[mode]
    return f"{answer} (computed from a corrupted prefix)"


# --- the store ---------------------------------------------------------------------------------------


class FakeStore:
    """The shared Mooncake store: which block hashes some replica has saved."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: set[str] = set()

    def put(self, hashes: Sequence[str]) -> int:
        """Saves the missing blocks; returns how many were new (vLLM checks existence, then puts)."""
        with self._lock:
            new = [block for block in hashes if block not in self._blocks]
            self._blocks.update(new)
            return len(new)

    def missing(self, hashes: Sequence[str]) -> list[str]:
        with self._lock:
            return [block for block in hashes if block not in self._blocks]

    def __contains__(self, block: object) -> bool:
        with self._lock:
            return block in self._blocks

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    cache_salt: str | None = None
    body: dict[str, Any] | None = None


@dataclass(frozen=True)
class OtherTraffic:
    """Other users' requests the replica serves beside each chat request (concurrently, in the same
    window): counted as finished requests that hit the store and drafted, like real users'."""

    requests: int = 2
    prompt_tokens: int = 200
    external_hit_tokens: int = 160
    drafts: int = 10


@dataclass
class _Metrics:
    registry: prometheus_client.CollectorRegistry
    counters: dict[str, prometheus_client.Counter] = field(default_factory=dict)
    gauges: dict[str, prometheus_client.Gauge] = field(default_factory=dict)
    histograms: dict[str, prometheus_client.Histogram] = field(default_factory=dict)


# What users feel, as vLLM exports it (the dashboard's first row): gauges and histograms by engine.
_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
_HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds")
# The latencies a fake answer reports: fixed, so a test can tell them apart.
FAKE_TIME_TO_FIRST_TOKEN_S = 0.05
FAKE_INTER_TOKEN_LATENCY_S = 0.01
# Blocks the fake's KV cache holds, for vllm:kv_cache_usage_perc.
_KV_CACHE_BLOCKS = 4096


def _build_metrics(model: str) -> _Metrics:
    """vLLM's counters; like vLLM, the per-engine ones exist (at 0) from start-up, the store ones
    appear with their first operation (their HELP/TYPE lines from start-up)."""
    registry = prometheus_client.CollectorRegistry()
    metrics = _Metrics(registry)
    engine = {"model_name": model, "engine": "0"}
    for name in (
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:external_prefix_cache_queries",
        "vllm:external_prefix_cache_hits",
        "vllm:prompt_tokens",
    ):
        metrics.counters[name] = prometheus_client.Counter(name, name, list(engine), registry=registry)
        metrics.counters[name].labels(**engine)
    by_source = "vllm:prompt_tokens_by_source"
    metrics.counters[by_source] = prometheus_client.Counter(
        by_source, by_source, [*engine, "source"], registry=registry
    )
    for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        metrics.counters[by_source].labels(**engine, source=source)
    success = "vllm:request_success"
    metrics.counters[success] = prometheus_client.Counter(
        success, success, [*engine, "finished_reason"], registry=registry
    )
    for reason in ("stop", "length", "abort"):
        metrics.counters[success].labels(**engine, finished_reason=reason)
    for name in (
        "vllm:mooncake_store_operation_total",
        "vllm:mooncake_store_operation_keys_total",
        "vllm:mooncake_store_operation_failed_keys_total",
    ):
        metrics.counters[name] = prometheus_client.Counter(
            name, name, [*engine, "operation", "status"], registry=registry
        )
    for name in _GAUGES:
        metrics.gauges[name] = prometheus_client.Gauge(name, name, list(engine), registry=registry)
        metrics.gauges[name].labels(**engine).set(0)
    for name in _HISTOGRAMS:
        metrics.histograms[name] = prometheus_client.Histogram(
            name, name, list(engine), registry=registry, buckets=(0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
        )
        metrics.histograms[name].labels(**engine)
    return metrics


_SPEC_DECODE = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


def _add_spec_decode_metrics(metrics: _Metrics, model: str) -> None:
    """vLLM registers these at start-up (at 0) when a speculative config is set."""
    engine = {"model_name": model, "engine": "0"}
    for name in _SPEC_DECODE:
        metrics.counters[name] = prometheus_client.Counter(
            name, name, list(engine), registry=metrics.registry
        )
        metrics.counters[name].labels(**engine)


@dataclass(frozen=True)
class Admission:
    """What the scheduler decided for one request: tokens from the local cache, from the store."""

    local: int
    external: int

    @property
    def loaded(self) -> bool:
        return self.external > 0


class FakeReplica:
    """One fake vLLM server. Attributes may be changed while it runs (tests flip modes mid-run)."""

    def __init__(
        self,
        store: FakeStore,
        *,
        mode: Mode = Mode.CORRECT,
        model: str = DEFAULT_MODEL,
        block_size: int = 32,
        eagle: bool = True,
        latency_s: float = 0.0,
        prompt_tokens_details: bool = True,
        per_request_spec_metrics: bool | None = None,
        reasoning: Literal["parser", "raw"] | None = None,
        put_delay_s: float = 0.0,
        puts: Literal["ok", "never", "fail"] = "ok",
        other_traffic: OtherTraffic | None = None,
    ) -> None:
        self.store = store
        self.mode = mode
        self.model = model
        self.block_size = block_size
        self.eagle = eagle
        self.latency_s = latency_s
        # vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens.
        self.prompt_tokens_details = prompt_tokens_details
        # vLLM's --per-request-spec-decode-metrics summary: metrics.speculative_decoding (with Eagle).
        self.per_request_spec_metrics = (
            eagle if per_request_spec_metrics is None else per_request_spec_metrics
        )
        self.reasoning = reasoning
        self.put_delay_s = put_delay_s
        self.puts = puts
        self.other_traffic = other_traffic
        self.healthy = True
        # With Eagle: whether the drafter runs (its counters rise); False: a request that turned it off.
        self.spec_decode_runs = True
        # Whether the replica honours `logprobs` (a proxy that strips them: False).
        self.sends_logprobs = True
        # Whether it honours `return_tokens_as_token_ids` (an older server: text tokens).
        self.token_ids = True
        self.detokenize_status = 200
        self.tokenize_status = 200
        # A careless server that quotes the request's credentials (basic auth) in its error messages.
        self.echo_auth = False
        self.max_model_len = 4096
        # Rewrites of what the replica sends (tests of answers and metrics pages a real vLLM would not
        # give): a chat payload -> payload, a metrics page -> page.
        self.payload_filter: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        self.metrics_filter: Callable[[str], str] | None = None
        self.requests: list[RecordedRequest] = []
        self._local_blocks: set[str] = set()
        self._lock = threading.Lock()
        self._metrics = _build_metrics(model)
        if eagle:
            _add_spec_decode_metrics(self._metrics, model)
        self._release = threading.Event()
        self._timers: list[threading.Timer] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="fake-vllm", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeReplica:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._release.set()  # hung handlers return (to a client long gone)
        for timer in self._timers:
            timer.cancel()
        if self._thread.is_alive():
            self._server.shutdown()  # waits for serve_forever, so only once it runs
            self._thread.join(timeout=5)
        self._server.server_close()

    def requests_to(self, path: str) -> list[RecordedRequest]:
        return [request for request in self.requests if request.path == path]

    def counter(self, name: str, **labels: str) -> float:
        """Current value of one of the replica's counters (sum over matching label sets)."""
        return sum(
            sample.value
            for metric in self._metrics.registry.collect()
            for sample in metric.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )

    # -- hooks for adversarial replicas ----------------------------------------------------------

    def shape_tokens(self, tokens: list[Token], *, admission: Admission, body: dict[str, Any]) -> list[Token]:
        """The generated tokens as this replica returns them (default: as computed)."""
        return tokens

    def shape_payload(self, payload: dict[str, Any], *, admission: Admission) -> dict[str, Any]:
        """The chat completion as this replica sends it (default: as built)."""
        return payload

    # -- chat completions ----------------------------------------------------------------------

    def generation_text(self, messages: Sequence[dict[str, Any]], admission: Admission) -> str:
        """The raw generated text: reasoning (for a reasoning model), then the answer."""
        answer = answer_for(messages)
        if admission.loaded and self.mode in _CORRUPTED_ANSWERS:
            answer = corrupt(self.mode, answer)
        if self.reasoning is None:
            return answer
        # The chat template opens the think block; the model writes its reasoning and closes it.
        return f"{REASONING}{THINK_END}\n\n{answer}"

    def complete(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """vLLM's answer to a chat completion body: (status, JSON payload)."""
        if body.get("model") != self.model:
            message = f"The model `{body.get('model')}` does not exist."
            return 404, {"error": {"message": message, "type": "NotFoundError", "param": None, "code": 404}}
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            message = "messages: field required"
            return 400, {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
        prompt = tokenize(messages)
        salt = None if self.mode is Mode.IGNORES_SALT else body.get("cache_salt")
        hashes = block_hashes(prompt, self.block_size, salt)
        engine = {"model_name": self.model, "engine": "0"}
        self._metrics.gauges["vllm:num_requests_running"].labels(**engine).inc()
        try:
            with self._lock:
                admission = self._admit(hashes, len(prompt))
                self._store_prompt(hashes)
            return 200, self._answer(body, messages, prompt, admission)
        finally:
            self._metrics.gauges["vllm:num_requests_running"].labels(**engine).dec()

    def _answer(
        self, body: dict[str, Any], messages: list[Any], prompt: list[str], admission: Admission
    ) -> dict[str, Any]:
        engine = {"model_name": self.model, "engine": "0"}
        tokens = self.shape_tokens(
            tokens_for(self.generation_text(messages, admission)), admission=admission, body=body
        )
        max_tokens = body.get("max_tokens")
        finish = "stop"
        if isinstance(max_tokens, int) and len(tokens) > max_tokens:
            tokens, finish = tokens[:max_tokens], "length"
        ids = [token.token_id for token in tokens]
        self._observe_latencies(len(ids))
        message = self._message(ids)
        count = self._metrics.counters
        count["vllm:request_success"].labels(**engine, finished_reason=finish).inc()
        count["vllm:prompt_tokens"].labels(**engine).inc(len(prompt))
        spec = None
        if self.eagle and self.spec_decode_runs:
            steps = max(1, len(tokens) // 2)
            count["vllm:spec_decode_num_drafts"].labels(**engine).inc(steps)
            count["vllm:spec_decode_num_draft_tokens"].labels(**engine).inc(SPEC_TOKENS * steps)
            count["vllm:spec_decode_num_accepted_tokens"].labels(**engine).inc(steps)
            histogram = [0] * (SPEC_TOKENS + 1)
            histogram[1] = steps
            spec = {
                "mean_acceptance_length": 2.0,
                "draft_acceptance_rate": 1 / SPEC_TOKENS,
                "acceptance_histogram": histogram,
                "num_spec_steps": steps,
                "num_accepted_draft_tokens": steps,
                "num_draft_tokens": SPEC_TOKENS * steps,
                "num_spec_tokens": SPEC_TOKENS,
            }
        if self.other_traffic is not None:
            self._serve_others(self.other_traffic)
        usage: dict[str, Any] = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(tokens),
            "total_tokens": len(prompt) + len(tokens),
        }
        if self.prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": admission.local + admission.external}
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
        top = body.get("top_logprobs")
        if body.get("logprobs") and self.sends_logprobs:
            as_ids = bool(body.get("return_tokens_as_token_ids")) and self.token_ids
            choice["logprobs"] = logprobs_payload(tokens, top if isinstance(top, int) else 0, as_ids=as_ids)
        payload: dict[str, Any] = {
            "id": f"chatcmpl-{hashlib.sha256(repr(time.time_ns()).encode()).hexdigest()[:16]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }
        if spec is not None and self.per_request_spec_metrics:
            payload["metrics"] = {"speculative_decoding": spec}
        return self.shape_payload(payload, admission=admission)

    def _message(self, ids: list[int]) -> dict[str, Any]:
        """The message as vLLM builds it: with a reasoning parser the text before `</think>` is the
        reasoning and the text after it the content (null when not reached or empty)."""
        if self.reasoning != "parser":
            return {"role": "assistant", "content": VOCAB.decode(ids), "reasoning": None}
        end = VOCAB.word(THINK_END)
        if end not in ids:
            return {"role": "assistant", "content": None, "reasoning": VOCAB.decode(ids)}
        split = ids.index(end)
        content = VOCAB.decode(ids[split + 1 :]) or None
        return {"role": "assistant", "content": content, "reasoning": VOCAB.decode(ids[:split])}

    def _serve_others(self, traffic: OtherTraffic) -> None:
        engine = {"model_name": self.model, "engine": "0"}
        count = self._metrics.counters
        count["vllm:request_success"].labels(**engine, finished_reason="stop").inc(traffic.requests)
        count["vllm:prompt_tokens"].labels(**engine).inc(traffic.requests * traffic.prompt_tokens)
        count["vllm:external_prefix_cache_hits"].labels(**engine).inc(
            traffic.requests * traffic.external_hit_tokens
        )
        count["vllm:external_prefix_cache_queries"].labels(**engine).inc(
            traffic.requests * traffic.prompt_tokens
        )
        self._count_store("load_get", traffic.requests * (traffic.external_hit_tokens // self.block_size))
        if self.eagle:
            count["vllm:spec_decode_num_drafts"].labels(**engine).inc(traffic.drafts)
            count["vllm:spec_decode_num_draft_tokens"].labels(**engine).inc(SPEC_TOKENS * traffic.drafts)

    def _observe_latencies(self, completion_tokens: int) -> None:
        engine = {"model_name": self.model, "engine": "0"}
        histograms = self._metrics.histograms
        histograms["vllm:time_to_first_token_seconds"].labels(**engine).observe(FAKE_TIME_TO_FIRST_TOKEN_S)
        for _ in range(max(completion_tokens - 1, 0)):
            histograms["vllm:inter_token_latency_seconds"].labels(**engine).observe(
                FAKE_INTER_TOKEN_LATENCY_S
            )
        with self._lock:
            usage = min(len(self._local_blocks) / _KV_CACHE_BLOCKS, 1.0)
        self._metrics.gauges["vllm:kv_cache_usage_perc"].labels(**engine).set(usage)

    def _admit(self, hashes: list[str], prompt_tokens: int) -> Admission:
        """The scheduler's admission: local hit, then the connector's external hit; counts both."""
        size = self.block_size
        local_blocks = self._longest_hit((prompt_tokens - 1) // size, hashes, self._local_blocks.__contains__)
        local = local_blocks * size
        lookup = self._store_lookup(hashes, prompt_tokens)
        external = lookup - local if lookup > local else 0
        loaded_blocks = external // size
        if external and self.mode is Mode.DOUBLE_PRUNE:
            loaded_blocks -= 1

        engine = {"model_name": self.model, "engine": "0"}
        count = self._metrics.counters
        count["vllm:prefix_cache_queries"].labels(**engine).inc(prompt_tokens)
        count["vllm:prefix_cache_hits"].labels(**engine).inc(local)
        count["vllm:external_prefix_cache_queries"].labels(**engine).inc(prompt_tokens - local)
        count["vllm:external_prefix_cache_hits"].labels(**engine).inc(external)
        by_source = count["vllm:prompt_tokens_by_source"]
        by_source.labels(**engine, source="local_compute").inc(prompt_tokens - local - external)
        by_source.labels(**engine, source="local_cache_hit").inc(local)
        by_source.labels(**engine, source="external_kv_transfer").inc(external)
        self._count_store("lookup_exists", min(len(hashes), prompt_tokens // size))
        if loaded_blocks > 0:
            failed = loaded_blocks if self.mode is Mode.LOAD_FAILS_RECOMPUTE else 0
            self._count_store("load_get", loaded_blocks, failed=failed)
        return Admission(local, external)

    def _store_lookup(self, hashes: list[str], prompt_tokens: int) -> int:
        """MooncakeStore's lookup: full prompt blocks, Eagle drop, redone one token short on a full hit."""
        if self.mode is Mode.NEVER_LOADS:
            return 0
        size = self.block_size

        def hit(limit_tokens: int) -> int:
            blocks = self._longest_hit(limit_tokens // size, hashes, self.store.__contains__)
            if self.eagle and blocks:
                blocks -= 1
            return blocks * size

        found = hit(prompt_tokens)
        if found >= prompt_tokens:
            found = hit(prompt_tokens - 1)
        return found

    def _store_prompt(self, hashes: list[str]) -> None:
        """After computing, the prompt's full blocks enter the local cache and, from a sending thread
        (`put_delay_s` later), the store; the put is counted when it returns."""
        self._local_blocks.update(hashes)
        self._count_store("save_exists", len(hashes))
        missing = self.store.missing(hashes)
        if not missing or self.puts == "never":
            return
        if self.put_delay_s <= 0:
            self._put(missing)
            return
        timer = threading.Timer(self.put_delay_s, self._put, args=(missing,))
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def _put(self, blocks: list[str]) -> None:
        if self.puts == "fail":
            self._count_store("save_put", len(blocks), failed=len(blocks))
            return
        new = self.store.put(blocks)
        if new:
            self._count_store("save_put", new)

    def _count_store(self, operation: str, keys: int, *, failed: int = 0) -> None:
        status = "ok" if not failed else "error" if failed == keys else "partial_failure"
        labels = {"model_name": self.model, "engine": "0", "operation": operation, "status": status}
        self._metrics.counters["vllm:mooncake_store_operation_total"].labels(**labels).inc()
        self._metrics.counters["vllm:mooncake_store_operation_keys_total"].labels(**labels).inc(keys)
        self._metrics.counters["vllm:mooncake_store_operation_failed_keys_total"].labels(**labels).inc(failed)

    @staticmethod
    def _longest_hit(limit_blocks: int, hashes: list[str], present: Any) -> int:
        blocks = 0
        for block in hashes[: max(limit_blocks, 0)]:
            if not present(block):
                break
            blocks += 1
        return blocks

    # -- metrics ---------------------------------------------------------------------------------

    def metrics_text(self) -> str:
        text = self._metrics_text()
        return self.metrics_filter(text) if self.metrics_filter is not None else text

    def _metrics_text(self) -> str:
        if self.mode is Mode.METRICS_WITHOUT_COUNTERS:
            registry = prometheus_client.CollectorRegistry()
            gauge = prometheus_client.Gauge(
                "vllm:num_requests_running", "Running requests.", ["model_name"], registry=registry
            )
            gauge.labels(model_name=self.model).set(0)
            return prometheus_client.generate_latest(registry).decode()
        return prometheus_client.generate_latest(self._metrics.registry).decode()


def _handler_for(replica: FakeReplica) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, like uvicorn
        disable_nagle_algorithm = True  # headers and body go out in two writes

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: tests read replica.requests instead."""

        def do_GET(self) -> None:
            replica.requests.append(RecordedRequest("GET", self.path))
            if replica.mode is Mode.NOT_VLLM:
                self._not_vllm()
            elif self.path == "/metrics" and replica.mode is not Mode.NO_METRICS:
                self._send(200, replica.metrics_text().encode(), "text/plain; version=0.0.4; charset=utf-8")
            elif self.path == "/health":
                self._send(200 if replica.healthy else 503, b"", "application/json")
            elif self.path == "/v1/models":
                models = {"object": "list", "data": [{"id": replica.model, "object": "model"}]}
                self._json(200, models)
            else:
                self._json(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                body = json.loads(raw)
            except json.JSONDecodeError:
                body = {}
            salt = body.get("cache_salt") if isinstance(body, dict) else None
            replica.requests.append(
                RecordedRequest("POST", self.path, salt, body if isinstance(body, dict) else None)
            )
            if replica.latency_s:
                time.sleep(replica.latency_s)
            mode = replica.mode
            if mode is Mode.NOT_VLLM:
                self._not_vllm()
            elif self.path == "/tokenize" and replica.tokenize_status != 200:
                error = {"message": f"tokenizer unavailable{self._auth()}", "type": "InternalServerError"}
                self._json(replica.tokenize_status, {"error": {**error, "code": replica.tokenize_status}})
            elif (
                self.path == "/tokenize" and isinstance(body, dict) and isinstance(body.get("messages"), list)
            ):
                count = len(tokenize(body["messages"]))
                self._json(200, {"count": count, "max_model_len": replica.max_model_len, "tokens": []})
            elif (
                self.path == "/detokenize" and isinstance(body, dict) and isinstance(body.get("tokens"), list)
            ):
                if replica.detokenize_status != 200:
                    message = f"detokenize failed{self._auth()}"
                    error = {"message": message, "type": "InternalServerError", "code": 500}
                    self._json(replica.detokenize_status, {"error": error})
                else:
                    self._json(200, {"prompt": VOCAB.decode([int(token) for token in body["tokens"]])})
            elif self.path != "/v1/chat/completions":
                self._json(404, {"detail": "Not Found"})
            elif mode is Mode.HANG:
                replica._release.wait(_HANG_LIMIT_S)
                self._json(503, {"error": {"message": "released", "type": "Hang", "code": 503}})
            elif mode is Mode.HTTP_500:
                message = f"EngineCore encountered an issue.{self._auth()}"
                error = {"message": message, "type": "InternalServerError"}
                self._json(500, {"error": {**error, "param": None, "code": 500}})
            elif mode is Mode.NON_JSON:
                self._send(200, b"OK: request accepted\n", "text/plain")
            elif mode is Mode.NO_CHOICES:
                self._json(200, {"id": "chatcmpl-x", "object": "chat.completion", "usage": {}})
            else:
                status, payload = replica.complete(body if isinstance(body, dict) else {})
                if status == 200 and replica.payload_filter is not None:
                    payload = replica.payload_filter(payload)
                self._json(status, payload)

        def _auth(self) -> str:
            """With echo_auth: the basic-auth credentials, decoded, as a careless server quotes them."""
            header = self.headers.get("Authorization", "")
            if not replica.echo_auth or not header.startswith("Basic "):
                return ""
            return f" (request from {base64.b64decode(header[6:]).decode()})"

        def _not_vllm(self) -> None:
            if self.path == "/":
                self._send(200, b"<html><body>Welcome to some web server</body></html>", "text/html")
            else:
                self._send(404, b"<html><body>404 Not Found</body></html>", "text/html")

        def _json(self, status: int, payload: dict[str, Any]) -> None:
            self._send(status, json.dumps(payload).encode(), "application/json")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            try:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (a timeout test); nothing to answer

    return Handler


class FakeCluster:
    """N fake replicas sharing one FakeStore."""

    def __init__(self, replicas: list[FakeReplica], store: FakeStore) -> None:
        self.replicas = replicas
        self.store = store

    @classmethod
    @contextmanager
    def start(
        cls,
        count: int = 2,
        *,
        modes: Sequence[Mode] | None = None,
        kinds: Sequence[type[FakeReplica]] | None = None,
        **replica_options: Any,
    ) -> Iterator[FakeCluster]:
        """Start `count` replicas (modes[i] for the i-th, default correct; kinds[i] its class, default
        FakeReplica); stop them all on exit."""
        modes = list(modes) if modes is not None else [Mode.CORRECT] * count
        classes = list(kinds) if kinds is not None else [FakeReplica] * count
        if len(modes) != count or len(classes) != count:
            raise ValueError(
                f"{count} replicas need {count} modes and kinds, got {len(modes)}, {len(classes)}"
            )
        store = FakeStore()
        replicas: list[FakeReplica] = []
        try:
            for mode, kind in zip(modes, classes, strict=True):
                replicas.append(kind(store, mode=mode, **replica_options).start())
            yield cls(replicas, store)
        finally:
            for replica in replicas:
                replica.stop()

    @property
    def urls(self) -> list[str]:
        return [replica.url for replica in self.replicas]

    def __getitem__(self, index: int) -> FakeReplica:
        return self.replicas[index]

    def __len__(self) -> int:
        return len(self.replicas)
