"""The default suite: prompts padded to exact lengths around KV block boundaries, counted by a tokenizer."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from mooncake_operator.canary.metrics import expected_external_hit_tokens
from mooncake_operator.canary.request import (
    MANY_BLOCKS,
    MIN_BOUNDARY_BLOCKS,
    PADDING_INTRO,
    SUITE_MAX_TOKENS,
    SuiteError,
    TokenCount,
    boundary_targets,
    build_suite,
    default_suite,
    pad_to_length,
    padded_request,
    parse_token_count,
    reference_expectations,
    reference_request,
    suite_cost,
    vllm_token_counter,
)

pytestmark = pytest.mark.unit


def word_tokens(word: str) -> int:
    """A toy BPE: short words are one token, longer ones one per 4 characters."""
    return max(1, -(-len(word) // 4))


class ToyTokenizer:
    """Counts a chat request like a chat template would: per-message overhead plus word tokens."""

    def __init__(self, *, per_word: Any = word_tokens, max_model_len: int | None = 4096) -> None:
        self.per_word = per_word
        self.max_model_len = max_model_len
        self.calls = 0

    def tokens(self, request: dict[str, Any]) -> int:
        total = 3  # the generation prompt
        for message in request["messages"]:
            total += 4 + sum(self.per_word(word) for word in message["content"].split())
        return total

    async def __call__(self, request: dict[str, Any]) -> TokenCount:
        self.calls += 1
        return TokenCount(self.tokens(request), self.max_model_len)


# --- the boundary arithmetic ----------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 32])
def test_targets_are_a_boundary_one_past_one_short_and_many_blocks(block_size: int) -> None:
    targets = {name: length for name, length, _ in boundary_targets(60, block_size)}
    boundary = targets["block-end"]

    assert boundary % block_size == 0 and boundary // block_size >= MIN_BOUNDARY_BLOCKS
    assert targets["block-plus-one"] == boundary + 1
    assert targets["block-minus-one"] == boundary - 1
    assert targets["many-blocks"] // block_size >= MANY_BLOCKS
    assert targets["many-blocks"] % block_size == block_size // 2


def test_targets_lie_above_a_long_base_prompt() -> None:
    # The customer's prompt may already be long: every target must still be reachable by padding.
    for base in (0, 63, 64, 65, 200, 1000):
        lengths = [length for _, length, _ in boundary_targets(base, 16)]
        assert min(lengths) > base, (base, lengths)


@pytest.mark.parametrize("eagle", [True, False])
def test_with_the_double_prune_bug_every_boundary_request_still_loads_a_block(eagle: bool) -> None:
    # The buggy reader loads one block less than the hit; a suite request that leaves it nothing to
    # load would be Inconclusive instead of Failed.
    for _, length, _ in boundary_targets(10, 16):
        hit_blocks = expected_external_hit_tokens(length, 16, eagle=eagle) // 16
        assert hit_blocks - 1 >= 1, length


def test_targets_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="block_size"):
        boundary_targets(10, 0)
    with pytest.raises(ValueError, match="base_tokens"):
        boundary_targets(-1, 16)


# --- padding to an exact length --------------------------------------------------------------------


def test_padding_goes_in_its_own_exchange_before_the_last_message() -> None:
    base = reference_request()
    padded = padded_request(base, " record entry", max_tokens=7)

    assert padded["messages"][:-3] == base["messages"][:-1]
    assert padded["messages"][-3] == {"role": "user", "content": f"{PADDING_INTRO} record entry"}
    assert padded["messages"][-2]["role"] == "assistant"
    assert padded["messages"][-1] == base["messages"][-1]
    assert padded["max_tokens"] == 7
    assert base == reference_request(), "the base request is not changed"


@pytest.mark.parametrize("above", [0, 1, 2, 31, 32, 33, 300])
async def test_pad_to_length_is_exact(above: int) -> None:
    tokenizer = ToyTokenizer()
    target = tokenizer.tokens(padded_request(reference_request(), "")) + above
    filler, counts = await pad_to_length(reference_request(), target, tokenizer)

    assert tokenizer.tokens(padded_request(reference_request(), filler)) == target
    assert counts == tokenizer.calls < 40


async def test_pad_to_length_closes_a_gap_words_cannot_with_single_token_units() -> None:
    # Every padding word costs 3 tokens here; only a unit of one token lands on the other lengths.
    def per_word(word: str) -> int:
        return 1 if len(word) == 1 and word.isalpha() else 3

    tokenizer = ToyTokenizer(per_word=per_word)
    empty = tokenizer.tokens(padded_request(reference_request(), ""))
    for target in (empty + 50, empty + 51, empty + 52):
        filler, _ = await pad_to_length(reference_request(), target, tokenizer)
        assert tokenizer.tokens(padded_request(reference_request(), filler)) == target


async def test_pad_to_length_tries_other_units_when_one_costs_two_tokens() -> None:
    def per_word(word: str) -> int:
        return {"a": 2, "I": 2}.get(word, 1 if len(word) == 1 else 2)

    tokenizer = ToyTokenizer(per_word=per_word)
    target = tokenizer.tokens(padded_request(reference_request(), "")) + 51
    filler, _ = await pad_to_length(reference_request(), target, tokenizer)
    assert tokenizer.tokens(padded_request(reference_request(), filler)) == target
    assert filler.endswith(" x"), "the first unit that costs one token is used"


async def test_pad_to_length_says_when_no_exact_length_exists() -> None:
    # Two tokens for anything: odd lengths cannot be reached.
    tokenizer = ToyTokenizer(per_word=lambda word: 2)
    base_even = tokenizer.tokens(padded_request(reference_request(), ""))
    with pytest.raises(SuiteError, match="could not pad the prompt to exactly"):
        await pad_to_length(reference_request(), base_even + 41, tokenizer)


async def test_pad_to_length_refuses_a_target_below_the_base() -> None:
    with pytest.raises(SuiteError, match="more than the target"):
        await pad_to_length(reference_request(), 10, ToyTokenizer())


async def test_pad_to_length_refuses_a_tokenizer_that_counts_no_padding() -> None:
    tokenizer = ToyTokenizer(per_word=lambda word: 0)
    with pytest.raises(SuiteError, match="add no tokens"):
        await pad_to_length(reference_request(), 500, tokenizer)


# --- the suite --------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 32])
async def test_default_suite_is_the_customer_request_and_four_exact_boundary_requests(
    block_size: int,
) -> None:
    tokenizer = ToyTokenizer()
    expectations = reference_expectations()
    suite = await build_suite(
        reference_request(), tokenizer, block_size=block_size, expectations=expectations
    )

    assert [item.name for item in suite] == [
        "reference",
        "block-end",
        "block-plus-one",
        "block-minus-one",
        "many-blocks",
    ]
    customer = suite[0]
    assert customer.request == reference_request() and customer.expectations == expectations
    assert customer.prompt_tokens == tokenizer.tokens(reference_request())
    boundary = suite[1].prompt_tokens
    assert boundary is not None and boundary % block_size == 0
    for item in suite[1:]:
        assert tokenizer.tokens(item.request) == item.prompt_tokens, item.name
        assert item.expectations is None, "padded requests are judged warm against cold only"
        assert item.request["max_tokens"] == SUITE_MAX_TOKENS
        assert item.request["model"] == reference_request()["model"]
        assert item.request["temperature"] == 0 and item.request["seed"] == 0
    assert [item.prompt_tokens for item in suite[2:4]] == [boundary + 1, boundary - 1]


async def test_suite_keeps_a_shorter_answer_limit_of_the_base_request() -> None:
    base = {**reference_request(), "max_tokens": 5}
    suite = await build_suite(base, ToyTokenizer(), block_size=16)
    assert {item.request["max_tokens"] for item in suite} == {5}


async def test_suite_refuses_prompts_the_served_model_cannot_hold() -> None:
    with pytest.raises(SuiteError, match="max_model_len 250"):
        await build_suite(reference_request(), ToyTokenizer(max_model_len=250), block_size=16)


async def test_suite_refuses_a_request_without_messages() -> None:
    with pytest.raises(SuiteError, match="no messages"):
        await build_suite({"model": "m", "messages": []}, ToyTokenizer(), block_size=16)


async def test_suite_cost_counts_cold_and_warm_of_every_request() -> None:
    suite = await build_suite(reference_request(), ToyTokenizer(), block_size=16)
    cost = suite_cost(suite)

    prompts = sum(item.prompt_tokens or 0 for item in suite)
    assert cost.requests == 10
    assert cost.prompt_tokens == 2 * prompts
    assert cost.max_completion_tokens == 2 * (80 + 4 * SUITE_MAX_TOKENS)
    assert cost.per_run(2).requests == 20 and cost.per_run(2).prompt_tokens == 4 * prompts


# --- the served tokenizer: vLLM's /tokenize ------------------------------------------------------


def tokenize_server(
    seen: list[dict[str, Any]], *, status: int = 200, body: bytes | None = None
) -> httpx.AsyncClient:
    tokenizer = ToyTokenizer()

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/tokenize"
        payload = json.loads(request.content)
        seen.append(payload)
        if body is not None:
            return httpx.Response(status, content=body)
        count = tokenizer.tokens(payload)
        return httpx.Response(status, json={"count": count, "max_model_len": 4096, "tokens": [1] * count})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def test_default_suite_counts_with_the_replicas_tokenize_endpoint() -> None:
    seen: list[dict[str, Any]] = []
    base = {**reference_request(), "chat_template_kwargs": {"enable_thinking": False}}
    async with tokenize_server(seen) as client:
        suite = await default_suite(client, "http://replica:8000/", base, block_size=16)

    assert len(suite) == 5
    # Only what renders the prompt is sent: the messages, the model and the template's options.
    assert all(set(body) == {"messages", "model", "chat_template_kwargs"} for body in seen)
    assert seen[0]["messages"] == base["messages"]
    assert all(body["chat_template_kwargs"] == {"enable_thinking": False} for body in seen)


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (404, b'{"detail": "Not Found"}', "answered 404"),
        (200, b"<html>", "not JSON"),
        (200, b'{"tokens": []}', "without a token count"),
        (200, b'{"count": -3}', "without a token count"),
        (200, b'{"count": true}', "without a token count"),
        (200, b"[" + b"1," * 600_000 + b"1]", "over"),
    ],
)
async def test_a_bad_tokenize_answer_is_a_clear_error(status: int, body: bytes, message: str) -> None:
    async with tokenize_server([], status=status, body=body) as client:
        counter = vllm_token_counter(client, "http://replica:8000")
        with pytest.raises(SuiteError, match=message):
            await counter(reference_request())


async def test_an_unreachable_replica_is_a_clear_error() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client:
        with pytest.raises(SuiteError, match="ConnectError"):
            await vllm_token_counter(client, "http://replica:8000")(reference_request())


def test_parse_token_count_ignores_a_nonsense_max_model_len() -> None:
    assert parse_token_count("u", '{"count": 5, "max_model_len": -1}') == TokenCount(5, None)
    assert parse_token_count("u", '{"count": 5, "max_model_len": 4096}') == TokenCount(5, 4096)
