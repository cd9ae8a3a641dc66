"""The logprob rule: strict parsing of `choices[0].logprobs`, and benign versus corruption at the first
divergence (each rule, each malformed input)."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
from tests.support.fake_vllm import FakeCluster, answer_logprobs

from mooncake_operator.canary.client import parse_chat_response
from mooncake_operator.canary.divergence import LogprobsError, judge_divergence, parse_logprobs
from mooncake_operator.canary.metrics import ModelSeriesError, parse_samples, select_model, store_counters
from mooncake_operator.canary.models import (
    CanaryConfig,
    ChatAnswer,
    Comparison,
    ComparisonMode,
    DivergenceKind,
    ErrorKind,
    SuiteEntry,
    TokenLogprob,
    TopLogprob,
    Verdict,
)
from mooncake_operator.canary.report import render_json, render_table
from mooncake_operator.canary.runner import compare_answers, run_canary

pytestmark = pytest.mark.unit

DEFAULT = Comparison()


def tok(token: str, logprob: float, *top: tuple[str, float]) -> TokenLogprob:
    return TokenLogprob(token=token, logprob=logprob, top=[TopLogprob(token=t, logprob=lp) for t, lp in top])


def near_tie(first: str, second: str, gap: float) -> TokenLogprob:
    """`first` chosen, `second` runner-up `gap` nat below it."""
    return tok(first, -0.7, (first, -0.7), (second, -0.7 - gap), ("other", -3.0))


SHARED = [tok("The", -0.01, ("The", -0.01), ("A", -5.0)), tok(" answer", -0.02, (" answer", -0.02))]


# --- judging ----------------------------------------------------------------------------------------


def test_identical_tokens_are_no_divergence() -> None:
    assert judge_divergence(SHARED, list(SHARED), DEFAULT) is None


def test_a_near_tie_tipped_is_benign_with_its_margins() -> None:
    cold = [*SHARED, near_tie(" is", " was", 0.05)]
    warm = [*SHARED, near_tie(" was", " is", 0.04)]
    divergence = judge_divergence(cold, warm, DEFAULT)
    assert divergence is not None and divergence.kind is DivergenceKind.BENIGN
    assert (divergence.position, divergence.cold_token, divergence.warm_token) == (2, " is", " was")
    assert divergence.cold_gap_nats == pytest.approx(0.05)
    assert divergence.warm_gap_nats == pytest.approx(0.04)
    assert divergence.warm_token_rank_in_cold == divergence.cold_token_rank_in_warm == 2
    assert divergence.shared_tokens == 2 and divergence.max_drift_nats == 0.0
    assert divergence.reasons == []
    assert "benign divergence at token 2" in divergence.describe()


def test_a_divergence_at_token_zero_is_judged_without_shared_tokens() -> None:
    divergence = judge_divergence([near_tie("a", "b", 0.01)], [near_tie("b", "a", 0.01)], DEFAULT)
    assert divergence is not None and divergence.kind is DivergenceKind.BENIGN
    assert divergence.position == 0 and divergence.max_drift_nats is None


def test_a_token_outside_the_other_top_list_is_corruption() -> None:
    cold = [*SHARED, near_tie(" is", " was", 0.05)]
    warm = [*SHARED, tok(" garbage", -0.1, (" garbage", -0.1), (" zz", -2.0))]
    divergence = judge_divergence(cold, warm, DEFAULT)
    assert divergence is not None and divergence.kind is DivergenceKind.CORRUPTION
    assert divergence.cold_gap_nats is None and divergence.warm_gap_nats is None
    assert "the warm token is not in the cold answer's top-5" in divergence.reasons
    assert "the cold token is not in the warm answer's top-5" in divergence.reasons


@pytest.mark.parametrize("side", ["cold", "warm"])
def test_a_wide_gap_on_either_side_is_corruption(side: str) -> None:
    wide, narrow = near_tie(" is", " was", 0.5), near_tie(" was", " is", 0.05)
    if side == "warm":
        wide, narrow = near_tie(" is", " was", 0.05), near_tie(" was", " is", 0.5)
    divergence = judge_divergence([wide], [narrow], DEFAULT)
    assert divergence is not None and divergence.kind is DivergenceKind.CORRUPTION
    [reason] = divergence.reasons
    assert reason.startswith(f"the {side} answer's gap between the two tokens is 0.5000 nat, more than 0.125")


def test_the_gap_threshold_is_inclusive_and_configurable() -> None:
    cold, warm = [near_tie("a", "b", 0.125)], [near_tie("b", "a", 0.125)]
    divergence = judge_divergence(cold, warm, DEFAULT)
    assert divergence is not None and divergence.kind is DivergenceKind.BENIGN
    strict = judge_divergence(cold, warm, Comparison(max_tie_gap_nats=0.1))
    assert strict is not None and strict.kind is DivergenceKind.CORRUPTION


def test_drift_of_the_shared_tokens_before_the_divergence_is_corruption() -> None:
    cold = [tok("x", -0.1, ("x", -0.1)), tok("y", -0.2, ("y", -0.2)), near_tie("a", "b", 0.01)]
    warm = [tok("x", -0.1, ("x", -0.1)), tok("y", -0.5, ("y", -0.5)), near_tie("b", "a", 0.01)]
    divergence = judge_divergence(cold, warm, DEFAULT)
    assert divergence is not None and divergence.kind is DivergenceKind.CORRUPTION
    assert divergence.max_drift_nats == pytest.approx(0.3) and divergence.drift_position == 1
    assert divergence.reasons[0].startswith(
        "the shared tokens' logprobs drifted by up to 0.3000 nat (token 1)"
    )
    loose = judge_divergence(cold, warm, Comparison(max_drift_nats=0.5))
    assert loose is not None and loose.kind is DivergenceKind.BENIGN


@pytest.mark.parametrize(("cold_length", "warm_length", "ended"), [(2, 3, "cold"), (3, 2, "warm")])
def test_one_side_longer_is_corruption_never_a_tie(cold_length: int, warm_length: int, ended: str) -> None:
    tokens = [*SHARED, tok(" more", -0.01, (" more", -0.01))]
    divergence = judge_divergence(tokens[:cold_length], tokens[:warm_length], DEFAULT)
    assert divergence is not None and divergence.kind is DivergenceKind.CORRUPTION
    assert divergence.position == 2
    assert divergence.reasons == [
        f"the {ended} answer ends at token 2 where the {'warm' if ended == 'cold' else 'cold'} one goes on"
    ]


def test_a_divergence_at_the_last_token_is_judged() -> None:
    cold = [*SHARED, near_tie(".", "!", 0.02)]
    warm = [*SHARED, near_tie("!", ".", 0.02)]
    divergence = judge_divergence(cold, warm, DEFAULT)
    assert divergence is not None and divergence.position == 2 and divergence.kind is DivergenceKind.BENIGN


# --- comparing answers ------------------------------------------------------------------------------


def answer(text: str, logprobs: list[TokenLogprob] | None, prompt_tokens: int = 10) -> ChatAnswer:
    return ChatAnswer(url="http://a", status=200, text=text, prompt_tokens=prompt_tokens, logprobs=logprobs)


def test_a_benign_divergence_passes_the_comparison_with_a_note() -> None:
    cold = answer("The answer is", [*SHARED, near_tie(" is", " was", 0.05)])
    warm = answer("The answer was", [*SHARED, near_tie(" was", " is", 0.05)])
    result = compare_answers(cold, warm, DEFAULT)
    assert result.failures == [] and result.unjudged == []
    assert result.divergence is not None and result.divergence.kind is DivergenceKind.BENIGN
    assert result.mismatch is not None  # the text differs, and is shown
    assert result.notes[0].startswith("passed over a benign divergence at token 2")


def test_exact_mode_fails_the_same_benign_divergence() -> None:
    cold = answer("The answer is", [*SHARED, near_tie(" is", " was", 0.05)])
    warm = answer("The answer was", [*SHARED, near_tie(" was", " is", 0.05)])
    result = compare_answers(cold, warm, Comparison(mode=ComparisonMode.EXACT))
    assert result.divergence is None
    assert result.failures[0].startswith("warm answer differs from the cold one at character 11")


@pytest.mark.parametrize("missing", ["cold", "warm"])
def test_differing_answers_without_logprobs_are_unjudged_not_passed(missing: str) -> None:
    tokens = [*SHARED, near_tie(" is", " was", 0.05)]
    cold = answer("The answer is", None if missing == "cold" else tokens)
    warm = answer("The answer was", None if missing == "warm" else tokens)
    result = compare_answers(cold, warm, DEFAULT)
    assert result.failures == []
    assert result.divergence is not None and result.divergence.kind is DivergenceKind.UNJUDGED
    assert f"the {missing} answer sent no logprobs" in result.unjudged[0]


def test_equal_answers_without_logprobs_pass_as_before_with_a_note() -> None:
    result = compare_answers(answer("same", None), answer("same", None), DEFAULT)
    assert result.failures == result.unjudged == [] and result.divergence is None
    assert result.notes == [
        "the cold and warm answer sent no logprobs (the answers are equal, so none were needed)"
    ]


def test_identical_tokens_with_different_text_fail() -> None:
    result = compare_answers(answer("a", SHARED), answer("b", SHARED), DEFAULT)
    assert result.failures[0].endswith("although the tokens are identical")


# --- parsing ----------------------------------------------------------------------------------------


def entry(token: str = "a", logprob: Any = -0.1, top: Any = None) -> dict[str, Any]:
    return {
        "token": token,
        "logprob": logprob,
        "top_logprobs": top if top is not None else [{"token": token, "logprob": logprob}],
    }


def test_vllm_shaped_logprobs_parse() -> None:
    parsed = parse_logprobs(answer_logprobs("Hello world.", 5), top_k=5, max_entries=80)
    assert parsed is not None
    assert [item.token for item in parsed] == ["Hello", " world", "."]
    assert all(len(item.top) == 5 and item.top[0].token == item.token for item in parsed)


@pytest.mark.parametrize("raw", [None, {}, {"content": None}])
def test_absent_logprobs_are_none(raw: Any) -> None:
    assert parse_logprobs(raw, top_k=5, max_entries=10) is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"content": [entry(logprob=math.nan)]}, "logprob is nan: a log-probability is a finite number <= 0"),
        ({"content": [entry(logprob=0.5)]}, "logprob is 0.5"),
        ({"content": [entry(logprob=-math.inf)]}, "logprob is -inf"),
        ({"content": [entry(logprob="-0.1")]}, "logprob is str, not a number"),
        ({"content": [entry(logprob=True)]}, "logprob is bool, not a number"),
        ({"content": [entry(token=5)]}, "token is int, not text"),
        ({"content": [entry(token="\ud800")]}, "token is not valid Unicode text"),
        ({"content": [entry()] * 11}, "has 11 entries, more than the 10 tokens asked for"),
        (
            {"content": [entry(top=[{"token": str(i), "logprob": -i} for i in range(6)])]},
            "has 6 entries, more than the 5 asked",
        ),
        (
            {
                "content": [
                    entry(
                        "a",
                        -0.1,
                        [
                            {"token": "a", "logprob": -0.1},
                            {"token": "b", "logprob": -3.0},
                            {"token": "c", "logprob": -1.0},
                        ],
                    )
                ]
            },
            "is not sorted by logprob, descending",
        ),
        ({"content": [entry(top=[{"token": "b", "logprob": math.nan}])]}, "top_logprobs[0].logprob is nan"),
        ({"content": "abc"}, "logprobs.content is str, not a list"),
        ({"content": [5]}, "logprobs.content[0] is int, not an object"),
        ("abc", "logprobs is str"),
        ({"content": [entry(top="x")]}, "top_logprobs is str, not a list"),
    ],
)
def test_malformed_logprobs_are_refused(raw: Any, message: str) -> None:
    with pytest.raises(LogprobsError, match=None) as caught:
        parse_logprobs(raw, top_k=5, max_entries=10)
    assert message in str(caught.value)


def test_a_sampled_token_leading_an_otherwise_sorted_list_is_vllms_layout() -> None:
    top = [{"token": "c", "logprob": -2.0}, {"token": "a", "logprob": -0.1}, {"token": "b", "logprob": -0.5}]
    parsed = parse_logprobs({"content": [entry("c", -2.0, top)]}, top_k=5, max_entries=None)
    assert parsed is not None and [item.token for item in parsed[0].top] == ["c", "a", "b"]


def test_nan_logprobs_in_a_200_make_a_malformed_answer() -> None:
    payload = (
        '{"choices": [{"message": {"content": "a"}, "logprobs": {"content": '
        '[{"token": "a", "logprob": NaN, "top_logprobs": []}]}}], "usage": {"prompt_tokens": 3}}'
    )
    response = httpx.Response(200, text=payload, headers={"content-type": "application/json"})
    parsed = parse_chat_response(
        "http://a", response, latency_s=0.0, attempts=1, top_logprobs=5, max_tokens=80
    )
    assert parsed.error_kind is ErrorKind.MALFORMED
    assert parsed.error is not None and "impossible logprobs" in parsed.error and "nan" in parsed.error
    ignored = parse_chat_response("http://a", response, latency_s=0.0, attempts=1)
    assert ignored.ok and ignored.logprobs is None  # not asked for: not read


# --- the asked model's series only ------------------------------------------------------------------

TWO_MODELS = """\
vllm:external_prefix_cache_hits_total{model_name="small",engine="0"} 100
vllm:external_prefix_cache_hits_total{model_name="big",engine="0"} 5000
vllm:external_prefix_cache_hits_total{model_name="big",engine="1"} 7
vllm:spec_decode_num_drafts_total{model_name="big",engine="0"} 9
vllm:mooncake_store_operation_keys_total{model_name="small",engine="0",operation="load_get",status="ok"} 3
vllm:mooncake_store_operation_keys_total{model_name="big",engine="0",operation="load_get",status="ok"} 40
"""


def test_counters_are_the_asked_models_never_a_sum_across_models() -> None:
    samples = parse_samples(TWO_MODELS)
    big = store_counters(select_model(samples, "big"))
    assert big.external_hit_tokens == 5007 and big.store_keys_by_operation == {"load_get": 40}
    assert big.spec_decode_drafts == 9
    small = store_counters(select_model(samples, "small"))
    assert small.external_hit_tokens == 100 and small.spec_decode_drafts is None


def test_a_missing_model_or_an_unnamed_one_among_several_is_an_error() -> None:
    samples = parse_samples(TWO_MODELS)
    with pytest.raises(ModelSeriesError, match="for model 'other' \\(models on the page: big, small\\)"):
        select_model(samples, "other")
    with pytest.raises(ModelSeriesError, match="several models \\(big, small\\) and the request names none"):
        select_model(samples, None)
    one = parse_samples('vllm:external_prefix_cache_hits_total{model_name="m",engine="0"} 4\n')
    assert store_counters(select_model(one, None)).external_hit_tokens == 4


async def test_a_replica_serving_another_model_on_the_same_page_is_not_counted() -> None:
    with FakeCluster.start(2) as cluster:
        extra = '\nvllm:external_prefix_cache_hits_total{model_name="other",engine="0"} 99999\n'
        for replica in cluster:
            replica.metrics_filter = lambda page: page + extra
        result = await run_canary(
            CanaryConfig(replicas=cluster.urls, block_size=32, eagle=True, pairs="first")
        )
    assert result.verdict is Verdict.PASSED, result.reason
    assert result.pairs[0].external_hit_tokens == 128


# --- Eagle and the suite on fake replicas -----------------------------------------------------------


async def test_eagle_counters_that_do_not_rise_make_the_pair_inconclusive() -> None:
    with FakeCluster.start(2) as cluster:
        cluster[1].spec_decode_runs = False
        result = await run_canary(
            CanaryConfig(replicas=cluster.urls, block_size=32, eagle=True, pairs="first")
        )
    assert result.verdict is Verdict.INCONCLUSIVE
    assert "reader's vllm:spec_decode_num_drafts_total did not rise over the warm request" in result.reason


async def test_eagle_without_spec_decode_series_is_inconclusive_and_without_eagle_not_asked() -> None:
    with FakeCluster.start(2, eagle=False) as cluster:
        eagle = await run_canary(
            CanaryConfig(replicas=cluster.urls, block_size=32, eagle=True, pairs="first")
        )
        plain = await run_canary(CanaryConfig(replicas=cluster.urls, block_size=32, pairs="first"))
    assert eagle.verdict is Verdict.INCONCLUSIVE
    assert "reader's metrics have no vllm:spec_decode_num_drafts_total" in eagle.reason
    assert plain.verdict is Verdict.PASSED, plain.reason


async def test_a_user_suite_runs_after_the_request_with_its_cost() -> None:
    extra = SuiteEntry(
        name="short",
        request={
            "model": "MiniMaxAI/MiniMax-M2.5",
            "messages": [{"role": "user", "content": "hi " * 200}],
            "max_tokens": 8,
        },
    )
    with FakeCluster.start(2) as cluster:
        result = await run_canary(
            CanaryConfig(replicas=cluster.urls, block_size=32, eagle=True, pairs="first", suite=[extra])
        )
    assert result.verdict is Verdict.PASSED, result.reason
    assert result.requests == ["request", "short"]
    assert [pair.request_name for pair in result.pairs] == ["request", "short"]
    assert result.cost.chat_requests == 4
    answers = [a for pair in result.pairs for a in (pair.cold, pair.warm) if a is not None]
    assert result.cost.prompt_tokens == sum(a.prompt_tokens or 0 for a in answers) > 0
    assert result.cost.completion_tokens == sum(a.completion_tokens or 0 for a in answers) > 0


async def test_the_default_suite_runs_the_four_boundaries_counted_by_the_replica() -> None:
    with FakeCluster.start(2) as cluster:
        result = await run_canary(
            CanaryConfig(replicas=cluster.urls, block_size=32, eagle=True, pairs="first", suite="default")
        )
        tokenized = cluster[0].requests_to("/tokenize")
    assert result.verdict is Verdict.PASSED, result.reason
    assert result.requests == ["request", "block-end", "block-plus-one", "block-minus-one", "many-blocks"]
    assert tokenized
    prompts = {pair.request_name: pair.prompt_tokens for pair in result.pairs}
    assert prompts["block-end"] is not None and prompts["block-end"] % 32 == 0
    assert prompts["block-plus-one"] == prompts["block-end"] + 1


async def test_a_default_suite_that_cannot_be_built_is_never_passed() -> None:
    with FakeCluster.start(2) as cluster:
        for replica in cluster:
            replica.max_model_len = 64  # too short for any boundary prompt
        result = await run_canary(
            CanaryConfig(replicas=cluster.urls, block_size=32, eagle=True, pairs="first", suite="default")
        )
    assert result.verdict is Verdict.INCONCLUSIVE
    assert result.reason.startswith("the default block-boundary suite could not be built")
    assert result.requests == ["request"]


def test_requests_that_set_logprobs_themselves_are_refused() -> None:
    with pytest.raises(ValueError, match="must not set 'logprobs' or 'top_logprobs'"):
        CanaryConfig(
            replicas=["http://a:1", "http://b:1"],
            request={"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2},
        )


def test_suite_names_are_distinct_and_the_default_needs_a_block_size() -> None:
    entry_ = SuiteEntry(name="x", request={"messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(ValueError, match="distinct"):
        CanaryConfig(replicas=["http://a:1", "http://b:1"], suite=[entry_, entry_])
    with pytest.raises(ValueError, match="the default suite needs block_size"):
        CanaryConfig(replicas=["http://a:1", "http://b:1"], suite="default")


def _tie_at_the_end(choose: str, other: str, gap: float) -> Any:
    """A payload filter: the answer's last token becomes `choose`, a near tie `gap` nat above `other`."""

    def rewrite(payload: dict[str, Any]) -> dict[str, Any]:
        choice = payload["choices"][0]
        content = choice["logprobs"]["content"]
        last = content[-1]
        top = [{"token": choose, "logprob": -0.7}, {"token": other, "logprob": -0.7 - gap}]
        content[-1] = {**last, "token": choose, "logprob": -0.7, "top_logprobs": top}
        text = choice["message"]["content"]
        choice["message"]["content"] = text[: -len(last["token"])] + choose
        return payload

    return rewrite


PLAIN = {
    "model": "MiniMaxAI/MiniMax-M2.5",
    "messages": [{"role": "user", "content": "word " * 200}],
    "max_tokens": 8,
}


@pytest.mark.parametrize(("gap", "verdict"), [(0.05, Verdict.PASSED), (0.5, Verdict.FAILED)])
async def test_a_near_tie_on_fake_replicas_passes_reported_and_a_wide_one_fails(
    gap: float, verdict: Verdict
) -> None:
    with FakeCluster.start(2) as cluster:
        cluster[0].payload_filter = _tie_at_the_end(".", "!", gap)
        cluster[1].payload_filter = _tie_at_the_end("!", ".", gap)
        config = CanaryConfig(
            replicas=cluster.urls, request=PLAIN, expectations=[], block_size=32, eagle=True, pairs="first"
        )
        result = await run_canary(config)
    [pair] = result.pairs
    assert pair.verdict is verdict, pair.reasons
    assert pair.divergence is not None
    assert (pair.divergence.cold_token, pair.divergence.warm_token) == (".", "!")
    assert pair.divergence.cold_gap_nats == pytest.approx(gap)
    table = render_table(result)
    assert f"{pair.divergence.kind.value}@{pair.divergence.position} gap {gap:.3f}" in table
    assert "divergence: " in table
    assert json.loads(render_json(result))["pairs"][0]["divergence"]["kind"] == pair.divergence.kind.value
    if verdict is Verdict.PASSED:
        assert pair.notes[0].startswith("passed over a benign divergence")
        assert (
            "parts from it at a benign near tie (1 of them; pair 0: benign divergence at token"
            in result.reason
        )


async def test_exact_mode_asks_for_no_logprobs_and_fails_a_near_tie() -> None:
    with FakeCluster.start(2) as cluster:
        cluster[1].payload_filter = lambda payload: {
            **payload,
            "choices": [{**payload["choices"][0], "message": {"role": "assistant", "content": "other"}}],
        }
        config = CanaryConfig(
            replicas=cluster.urls,
            request=PLAIN,
            expectations=[],
            block_size=32,
            eagle=True,
            pairs="first",
            comparison=Comparison(mode=ComparisonMode.EXACT),
        )
        result = await run_canary(config)
    [pair] = result.pairs
    assert pair.cold is not None and pair.cold.logprobs is None  # not asked for
    assert pair.verdict is Verdict.FAILED and pair.divergence is None
    assert pair.reasons[0].startswith("warm answer differs from the cold one at character 0")
