"""The reference deployment's request and what its answer must hold, and the default suite: the
canary's defaults.

The body is the one the reference deployment sent in every trial of its bug report, byte for byte in content;
the expectations are theirs: one JSON object with the production update's values (us-west, 4, 16),
none of the superseded initial values (us-east, 2, 8), and nothing before the object (one of the
corrupted answers put a paraphrase of the system instruction there).

The default suite (`default_suite`) adds, beside that request, requests whose prompts end exactly on
a KV block boundary, one token past it, one token short of it, and one that spans many blocks. The
bug of vLLM PR #43516 drops the trailing block of a hit; where a trailing block falls depends on the
prompt's length modulo the block size, so one request of one length can miss what another shows.
Prompt lengths are counted by the served tokenizer itself (vLLM's `/tokenize`, which renders the
chat template exactly as the chat endpoint does), so the suite is exact for whatever model is served.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from mooncake_operator.canary.expectations import (
    Expectation,
    JsonObjectOnly,
    JsonValuesExclude,
    JsonValuesInclude,
)
from mooncake_operator.canary.urls import redact_url

_REFERENCE_REQUEST: dict[str, Any] = {
    "model": "MiniMaxAI/MiniMax-M2.5",
    "messages": [
        {
            "role": "system",
            "content": (
                "You maintain a deployment record. When a setting is updated, discard its previous "
                "value and answer only from the latest record."
            ),
        },
        {
            "role": "user",
            "content": "Initial rollout: region is us-east, replica count is 2, and maximum batch size is 8.",
        },
        {"role": "assistant", "content": "Recorded the initial rollout."},
        {
            "role": "user",
            "content": (
                "Production update: region is now us-west, replica count is 4, and maximum batch size "
                "is 16. The initial values are superseded."
            ),
        },
        {"role": "assistant", "content": "Recorded the production update."},
        {
            "role": "user",
            "content": "Return the current region, replica count, and maximum batch size as one JSON object.",
        },
    ],
    "temperature": 0,
    "seed": 0,
    "max_tokens": 80,
    "stream": False,
}


def reference_request() -> dict[str, Any]:
    """The reference deployment's chat request body (a fresh deep copy: callers may edit it)."""
    return copy.deepcopy(_REFERENCE_REQUEST)


def reference_expectations() -> list[Expectation]:
    """One JSON object holding us-west, 4 and 16, none of us-east, 2 and 8, nothing before it."""
    return [
        JsonObjectOnly(),
        JsonValuesInclude(values=["us-west", 4, 16]),
        JsonValuesExclude(values=["us-east", 2, 8]),
    ]


# --- the default suite ------------------------------------------------------------------------------

TOKENIZE_PATH = "/tokenize"
# Answer tokens of each boundary request: a wrong trailing block moves the first tokens' distribution
# already (the judge compares per-token logprobs from the first token on), so a short answer keeps
# the suite cheap; the reference request keeps its max_tokens.
SUITE_MAX_TOKENS = 32
# Whole blocks of the boundary prompts at least: with Eagle the lookup drops one block and the
# double-prune bug another, so fewer would leave the buggy reader nothing to load (Inconclusive).
MIN_BOUNDARY_BLOCKS = 4
# The long request's whole blocks (and half a block more, so its end falls mid-block).
MANY_BLOCKS = 16
# Fields of the chat request that change how vLLM renders its prompt; `/tokenize` takes the same.
_TEMPLATE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "documents",
    "mm_processor_kwargs",
)
# The padding turn inserted before the request's last message: plain words a tokenizer splits at
# spaces (each adds whole tokens), then single-token units to land on the exact count.
PADDING_INTRO = "Reference notes, no setting changes:"
PADDING_REPLY = "Noted."
_PADDING_WORDS = (
    "record",
    "entry",
    "audit",
    "check",
    "value",
    "unchanged",
    "setting",
    "note",
    "review",
    "logged",
)
_FINE_UNITS = (" a", " I", " x", " 0", " ok", " -", " ;", " .")
_MAX_FINE_UNITS = 64
_TOKENIZE_MAX_BODY_BYTES = 1024 * 1024

# Counts the prompt tokens of a chat request as the served engine renders it.
TokenCounter = Callable[[dict[str, Any]], Awaitable["TokenCount"]]


class SuiteError(Exception):
    """The default suite could not be built for this replica (tokenizer or length limits)."""


@dataclass(frozen=True)
class TokenCount:
    count: int
    max_model_len: int | None = None


@dataclass(frozen=True)
class SuiteRequest:
    """One request of a canary suite: its body, what its answers must hold, why it is there.

    `expectations` None: the request is judged warm against cold only (the padded requests: their
    filler may change what a real model answers, so content checks stay on the reference request).
    `prompt_tokens`: the exact prompt length the padding produced (None when not measured)."""

    name: str
    request: dict[str, Any]
    expectations: list[Expectation] | None
    prompt_tokens: int | None
    purpose: str


@dataclass(frozen=True)
class SuiteCost:
    """What one suite costs per pair: every request is sent twice (cold, then warm)."""

    requests: int
    prompt_tokens: int
    max_completion_tokens: int

    def per_run(self, pairs: int) -> SuiteCost:
        return SuiteCost(
            requests=self.requests * pairs,
            prompt_tokens=self.prompt_tokens * pairs,
            max_completion_tokens=self.max_completion_tokens * pairs,
        )


def boundary_targets(base_tokens: int, block_size: int) -> list[tuple[str, int, str]]:
    """(name, prompt length, purpose) of the four boundary requests for a prompt of `base_tokens`.

    The padding only adds tokens, so every target lies above `base_tokens` (with the padding turn's
    own tokens); the smallest boundary has at least MIN_BOUNDARY_BLOCKS whole blocks."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if base_tokens < 0:
        raise ValueError(f"base_tokens must be >= 0, got {base_tokens}")
    # k * block_size - 1 must exceed base_tokens: the shortest target (one short) is still reachable.
    blocks = max(MIN_BOUNDARY_BLOCKS, (base_tokens + 1) // block_size + 1)
    boundary = blocks * block_size
    many = max(MANY_BLOCKS, blocks + MIN_BOUNDARY_BLOCKS)
    return [
        ("block-end", boundary, f"prompt ends exactly on a block boundary ({blocks} blocks)"),
        (
            "block-plus-one",
            boundary + 1,
            f"prompt ends one token past a block boundary ({blocks} blocks + 1)",
        ),
        (
            "block-minus-one",
            boundary - 1,
            f"prompt ends one token short of a block boundary ({blocks} blocks - 1)",
        ),
        (
            "many-blocks",
            many * block_size + block_size // 2,
            f"prompt spans many blocks ({many} blocks + {block_size // 2})",
        ),
    ]


def padded_messages(base: dict[str, Any], filler: str) -> list[dict[str, Any]]:
    """`base`'s messages with a padding exchange (user filler, assistant reply) before the last one."""
    messages = copy.deepcopy(base["messages"])
    padding = [
        {"role": "user", "content": f"{PADDING_INTRO}{filler}"},
        {"role": "assistant", "content": PADDING_REPLY},
    ]
    return [*messages[:-1], *padding, messages[-1]]


def padded_request(base: dict[str, Any], filler: str, *, max_tokens: int | None = None) -> dict[str, Any]:
    request = copy.deepcopy(base)
    request["messages"] = padded_messages(base, filler)
    if max_tokens is not None:
        request["max_tokens"] = max_tokens
    return request


def _coarse_filler(words: int) -> str:
    return "".join(" " + _PADDING_WORDS[index % len(_PADDING_WORDS)] for index in range(words))


async def pad_to_length(base: dict[str, Any], target: int, count: TokenCounter) -> tuple[str, int]:
    """A filler that makes `base`'s padded prompt exactly `target` tokens: (filler, counts asked).

    Words first (the most that stay at or under the target, by bisection: a word adds at least one
    token), then the first single-token unit that closes the gap exactly. Every candidate is counted
    by `count` (the served tokenizer), so the result is exact or a SuiteError says why not."""
    counted: dict[str, int] = {}

    async def tokens(filler: str) -> int:
        if filler not in counted:
            counted[filler] = (await count(padded_request(base, filler))).count
        return counted[filler]

    empty = await tokens("")
    if empty > target:
        raise SuiteError(
            f"the request with an empty padding turn is already {empty} tokens, more than the target {target}"
        )
    low, high = 0, max(1, target - empty)
    while await tokens(_coarse_filler(high)) <= target:
        low, high = high, high * 2
        if high > 8 * target:
            raise SuiteError(f"padding words add no tokens (no count above {target} found)")
    # Invariant: tokens(low words) <= target < tokens(high words).
    while high - low > 1:
        middle = (low + high) // 2
        if await tokens(_coarse_filler(middle)) <= target:
            low = middle
        else:
            high = middle
    tried = []
    # One word fewer too: the last word may merge with what follows it into a count no unit can fix.
    for words in (low, low - 1) if low > 0 else (low,):
        coarse = _coarse_filler(words)
        gap = target - await tokens(coarse)
        if gap == 0:
            return coarse, len(counted)
        if gap > _MAX_FINE_UNITS:
            continue
        for unit in _FINE_UNITS:
            got = await tokens(coarse + unit * gap)
            if got == target:
                return coarse + unit * gap, len(counted)
            tried.append(f"{words} words + {unit!r} x {gap} -> {got}")
    raise SuiteError(
        f"could not pad the prompt to exactly {target} tokens with this tokenizer "
        f"(tried {'; '.join(tried) or 'nothing: the gap after the words is too large'}); "
        "supply your own suite"
    )


async def build_suite(
    base: dict[str, Any],
    count: TokenCounter,
    *,
    block_size: int,
    expectations: list[Expectation] | None = None,
    max_tokens: int = SUITE_MAX_TOKENS,
) -> list[SuiteRequest]:
    """`base` (judged with `expectations`, None: the canary's) plus the four boundary requests."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not isinstance(base.get("messages"), list) or not base["messages"]:
        raise SuiteError("the base request has no messages to pad (the suite pads chat requests)")
    measured = await count(copy.deepcopy(base))
    suite = [
        SuiteRequest(
            name="reference",
            request=copy.deepcopy(base),
            expectations=expectations,
            prompt_tokens=measured.count,
            purpose="the request the canary is configured with, with its content checks",
        )
    ]
    empty = await count(padded_request(base, ""))
    answer_tokens = min(max_tokens, base.get("max_tokens") or max_tokens)
    for name, target, purpose in boundary_targets(empty.count, block_size):
        limit = empty.max_model_len
        if limit is not None and target + answer_tokens > limit:
            raise SuiteError(
                f"the {name} request needs {target} prompt + {answer_tokens} answer tokens, more than the "
                f"served max_model_len {limit}; raise --max-model-len or supply your own suite"
            )
        filler, _ = await pad_to_length(base, target, count)
        suite.append(
            SuiteRequest(
                name=name,
                request=padded_request(base, filler, max_tokens=answer_tokens),
                expectations=None,
                prompt_tokens=target,
                purpose=purpose,
            )
        )
    return suite


def suite_cost(suite: list[SuiteRequest]) -> SuiteCost:
    """Requests and tokens of one pair (cold + warm per request); prompt tokens as measured."""
    return SuiteCost(
        requests=2 * len(suite),
        prompt_tokens=2 * sum(item.prompt_tokens or 0 for item in suite),
        max_completion_tokens=2 * sum(int(item.request.get("max_tokens") or 0) for item in suite),
    )


def vllm_token_counter(client: httpx.AsyncClient, base_url: str, *, timeout: float = 30.0) -> TokenCounter:
    """A TokenCounter backed by the replica's `/tokenize` (vLLM renders the chat template as for chat)."""
    url = base_url.rstrip("/") + TOKENIZE_PATH
    shown = redact_url(url)  # every message names this one: credentials never leave in an error

    async def count(request: dict[str, Any]) -> TokenCount:
        body: dict[str, Any] = {"messages": request["messages"]}
        if "model" in request:
            body["model"] = request["model"]
        body.update({key: request[key] for key in _TEMPLATE_FIELDS if key in request})
        try:
            async with client.stream("POST", url, json=body, timeout=timeout) as response:
                chunks: list[bytes] = []
                size = 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > _TOKENIZE_MAX_BODY_BYTES:
                        raise SuiteError(f"POST {shown}: answer over {_TOKENIZE_MAX_BODY_BYTES} bytes")
                    chunks.append(chunk)
        except httpx.HTTPError as error:
            raise SuiteError(f"POST {shown} failed: {type(error).__name__}: {error}") from None
        text = b"".join(chunks).decode("utf-8", "replace")
        if response.status_code != 200:
            raise SuiteError(f"POST {shown} answered {response.status_code}: {text[:300]}")
        return parse_token_count(shown, text)

    return count


def parse_token_count(url: str, text: str) -> TokenCount:
    """`count` (and `max_model_len`) of a vLLM /tokenize answer; SuiteError on anything else."""
    try:
        payload = json.loads(text)
    except json.JSONDecodeError:
        raise SuiteError(f"POST {url} answered a body that is not JSON: {text[:200]!r}") from None
    count = payload.get("count") if isinstance(payload, dict) else None
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise SuiteError(f"POST {url} answered without a token count: {text[:200]!r}")
    limit = payload.get("max_model_len")
    valid_limit = isinstance(limit, int) and not isinstance(limit, bool) and limit > 0
    return TokenCount(count=count, max_model_len=limit if valid_limit else None)


async def default_suite(
    client: httpx.AsyncClient,
    base_url: str,
    base: dict[str, Any],
    *,
    block_size: int,
    expectations: list[Expectation] | None = None,
    request_timeout_s: float = 30.0,
) -> list[SuiteRequest]:
    """The default suite for `base`, its lengths counted by the replica at `base_url` (any replica
    of the deployment: they serve one tokenizer)."""
    counter = vllm_token_counter(client, base_url, timeout=request_timeout_s)
    return await build_suite(base, counter, block_size=block_size, expectations=expectations)
