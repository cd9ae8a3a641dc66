"""Hand-made canary measurements for `judge_pair` tests: a healthy pair with every piece of evidence a
patched vLLM replica configured by the operator gives, each piece replaceable (dataclasses.replace)."""

from __future__ import annotations

from typing import Any

from tests.support.fake_vllm import CORRECT_ANSWER, SPEC_TOKENS, VOCAB, Token, healthy_token

from mooncake_operator.canary.models import (
    ChatAnswer,
    PutWait,
    PutWaitOutcome,
    SpecDecoding,
    StoreCounters,
    TokenLogprob,
    TopLogprob,
)
from mooncake_operator.canary.runner import PairMeasurement

PROMPT_TOKENS = 185
HIT = 128  # block 32, Eagle: 5 full blocks, one dropped


def token_logprobs(tokens: list[Token], top_k: int = 5) -> list[TokenLogprob]:
    return [
        TokenLogprob(
            token_id=token.token_id,
            logprob=token.logprob,
            top=[TopLogprob(token_id=i, logprob=lp) for i, lp in token.top[:top_k]],
        )
        for token in tokens
    ]


def answer_tokens(text: str = CORRECT_ANSWER) -> list[Token]:
    return [healthy_token(token_id) for token_id in VOCAB.encode(text)]


def answer(
    url: str,
    *,
    text: str = CORRECT_ANSWER,
    prompt_tokens: int = PROMPT_TOKENS,
    cached: int | None = None,
    tokens: list[Token] | None = None,
    spec: bool = False,
    **fields: Any,
) -> ChatAnswer:
    tokens = tokens if tokens is not None else answer_tokens(text)
    steps = max(1, len(tokens) // 2)
    return ChatAnswer(
        url=url,
        status=200,
        text=text,
        finish_reason="stop",
        prompt_tokens=prompt_tokens,
        completion_tokens=len(tokens),
        cached_tokens=cached,
        logprobs=token_logprobs(tokens),
        spec_decoding=SpecDecoding(
            num_spec_steps=steps,
            num_draft_tokens=SPEC_TOKENS * steps,
            num_accepted_draft_tokens=steps,
            num_spec_tokens=SPEC_TOKENS,
        )
        if spec
        else None,
        **fields,
    )


def served(requests: int, prompt_tokens: int, **fields: Any) -> StoreCounters:
    """Counters of a replica that finished `requests` requests of `prompt_tokens` prompt tokens in all."""
    return StoreCounters(
        requests_finished=requests,
        prompt_tokens=prompt_tokens,
        requests_running=0,
        requests_waiting=0,
        store_metrics_declared=True,
        **fields,
    )


def measurement(
    *,
    load_get: int = 4,
    warm_cached: int | None = HIT,
    cold_cached: int | None = 0,
    warm_prompt_tokens: int = PROMPT_TOKENS,
    spec: bool = True,
) -> PairMeasurement:
    """A healthy pair (Eagle, block 32): the reader loaded 128 tokens, the writer put 5 blocks."""
    spec_before = {"spec_decode_drafts": 0, "spec_decode_draft_tokens": 0}
    spec_after = {"spec_decode_drafts": 12, "spec_decode_draft_tokens": 36}
    return PairMeasurement(
        index=0,
        writer="http://a:1",
        reader="http://b:1",
        cache_salt="canary-x-0-y",
        cold=answer("http://a:1/v1/chat/completions", cached=cold_cached, spec=spec),
        warm=answer(
            "http://b:1/v1/chat/completions", prompt_tokens=warm_prompt_tokens, cached=warm_cached, spec=spec
        ),
        before=served(0, 0, external_hit_tokens=0, local_hit_tokens=0, **spec_before),
        after=served(
            1,
            warm_prompt_tokens,
            external_hit_tokens=HIT,
            local_hit_tokens=0,
            store_keys_by_operation={"load_get": load_get},
            **spec_after,
        ),
        metrics_error=None,
        wall_s=0.1,
        writer_before=served(0, 0, external_hit_tokens=0, local_hit_tokens=0),
        writer_after=served(
            1,
            PROMPT_TOKENS,
            external_hit_tokens=0,
            local_hit_tokens=0,
            store_keys_by_operation={"save_put": 5},
        ),
        put_wait=PutWait(
            outcome=PutWaitOutcome.COVERED, waited_s=0.01, polls=1, keys_needed=5, keys_reported=5
        ),
    )
