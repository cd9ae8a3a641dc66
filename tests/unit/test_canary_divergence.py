"""The logprob rules by token id: strict parsing of `choices[0].logprobs`, the drift over every shared
position (the union of both top lists), benign versus corruption at the first divergence, and the text
the shared tokens explain (each rule, each malformed input)."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
from tests.support.fake_vllm import VOCAB, FakeCluster, answer_logprobs

from mooncake_operator.canary.client import parse_chat_response
from mooncake_operator.canary.compare import shared_prefix
from mooncake_operator.canary.divergence import (
    LogprobsError,
    LogprobsUnusable,
    judge_divergence,
    judge_tokens,
    parse_logprobs,
)
from mooncake_operator.canary.metrics import ModelSeriesError, parse_samples, select_model, store_counters
from mooncake_operator.canary.models import (
    CanaryConfig,
    ChatAnswer,
    Comparison,
    ComparisonMode,
    DivergenceKind,
    ErrorKind,
    SharedText,
    SuiteEntry,
    TokenLogprob,
    TopLogprob,
    Verdict,
)
from mooncake_operator.canary.report import render_json, render_table
from mooncake_operator.canary.runner import compare_answers, run_canary

pytestmark = pytest.mark.unit

DEFAULT = Comparison()
THE, ANSWER, IS, WAS, OTHER = 11, 12, 13, 14, 15


def tok(token_id: int, logprob: float, *top: tuple[int, float]) -> TokenLogprob:
    return TokenLogprob(
        token_id=token_id, logprob=logprob, top=[TopLogprob(token_id=t, logprob=lp) for t, lp in top]
    )


def near_tie(first: int, second: int, gap: float, *, shift: float = 0.0) -> TokenLogprob:
    """`first` chosen, `second` runner-up `gap` nat below it; every logprob `shift` nat lower."""
    return tok(
        first,
        -0.7 - shift,
        (first, -0.7 - shift),
        (second, -0.7 - gap - shift),
        (OTHER, -3.0 - shift),
        (90, -4.0 - shift),
        (91, -5.0 - shift),
    )


def confident(token_id: int, logprob: float = -0.01, runner_up: float = -5.0) -> TokenLogprob:
    return tok(
        token_id,
        logprob,
        (token_id, logprob),
        (80, runner_up),
        (81, runner_up - 1),
        (82, runner_up - 2),
        (83, runner_up - 3),
    )


SHARED = [confident(THE), confident(ANSWER, -0.02)]


# --- judging ----------------------------------------------------------------------------------------


def test_identical_tokens_with_identical_distributions_are_no_divergence_and_no_drift() -> None:
    judgement = judge_tokens(SHARED, list(SHARED), DEFAULT)
    assert judgement.divergence is None and judgement.drift_problem is None
    assert judgement.evidence.positions == 2 and judgement.evidence.max_drift_nats == 0.0


def test_a_near_tie_tipped_is_benign_with_its_margins() -> None:
    cold = [*SHARED, near_tie(IS, WAS, 0.05)]
    warm = [*SHARED, near_tie(WAS, IS, 0.04)]
    divergence = judge_divergence(cold, warm, DEFAULT)
    assert divergence is not None and divergence.kind is DivergenceKind.BENIGN
    assert (divergence.position, divergence.cold_token, divergence.warm_token) == (
        2,
        "token_id:13",
        "token_id:14",
    )
    assert (divergence.cold_token_id, divergence.warm_token_id) == (IS, WAS)
    assert divergence.cold_gap_nats == pytest.approx(0.05)
    assert divergence.warm_gap_nats == pytest.approx(0.04)
    assert divergence.warm_token_rank_in_cold == divergence.cold_token_rank_in_warm == 2
    # Each candidate keeps its logprob across cold and warm (within the drift bound).
    # A flip of a near tie moves the two tokens by about the gaps: here 0.04 and 0.05 nat.
    assert divergence.cold_token_drift_nats == pytest.approx(0.04)
    assert divergence.warm_token_drift_nats == pytest.approx(0.05)
    assert divergence.shared_tokens == 2 and divergence.reasons == []
    assert "benign divergence at token 2" in divergence.describe()


def test_a_divergence_at_token_zero_is_judged_with_its_own_distribution() -> None:
    divergence = judge_divergence([near_tie(IS, WAS, 0.01)], [near_tie(WAS, IS, 0.01)], DEFAULT)
    assert divergence is not None and divergence.kind is DivergenceKind.BENIGN
    assert divergence.position == 0
    assert divergence.max_drift_nats == pytest.approx(0.01)  # the divergence position itself is compared


def test_a_token_outside_the_other_top_list_is_corruption() -> None:
    cold = [*SHARED, near_tie(IS, WAS, 0.05)]
    warm = [*SHARED, confident(77, -0.1)]
    divergence = judge_divergence(cold, warm, DEFAULT)
    assert divergence is not None and divergence.kind is DivergenceKind.CORRUPTION
    assert divergence.cold_gap_nats is None and divergence.warm_gap_nats is None
    assert "the warm token is not in the cold answer's top-5" in divergence.reasons
    assert "the cold token is not in the warm answer's top-5" in divergence.reasons


@pytest.mark.parametrize("side", ["cold", "warm"])
def test_a_wide_gap_on_either_side_is_corruption(side: str) -> None:
    wide, narrow = near_tie(IS, WAS, 0.5), near_tie(WAS, IS, 0.05)
    if side == "warm":
        wide, narrow = near_tie(IS, WAS, 0.05), near_tie(WAS, IS, 0.5)
    divergence = judge_divergence([wide], [narrow], DEFAULT)
    assert divergence is not None and divergence.kind is DivergenceKind.CORRUPTION
    assert divergence.reasons[0].startswith(
        f"the {side} answer's gap between the two tokens is 0.5000 nat, more than 0.125"
    )


def test_the_gap_threshold_is_inclusive_and_configurable() -> None:
    cold, warm = [near_tie(IS, WAS, 0.125)], [near_tie(WAS, IS, 0.125)]
    # Swapping places across 0.125 nat moves each token by 0.125: over the default drift bound.
    loose_drift = Comparison(max_drift_nats=0.2)
    divergence = judge_divergence(cold, warm, loose_drift)
    assert divergence is not None and divergence.kind is DivergenceKind.BENIGN
    strict = judge_divergence(cold, warm, loose_drift.model_copy(update={"max_tie_gap_nats": 0.1}))
    assert strict is not None and strict.kind is DivergenceKind.CORRUPTION
    default = judge_divergence(cold, warm, DEFAULT)
    assert default is not None and default.kind is DivergenceKind.CORRUPTION
    assert any("token moved by 0.1250 nat" in reason for reason in default.reasons)


def test_drift_of_the_shared_tokens_before_the_divergence_is_corruption() -> None:
    cold = [confident(1, -0.1), confident(2, -0.2), near_tie(IS, WAS, 0.01)]
    warm = [confident(1, -0.1), confident(2, -0.5), near_tie(WAS, IS, 0.01)]
    divergence = judge_divergence(cold, warm, DEFAULT)
    assert divergence is not None and divergence.kind is DivergenceKind.CORRUPTION
    assert divergence.max_drift_nats == pytest.approx(0.3) and divergence.drift_position == 1
    assert any(
        reason.startswith("the distributions moved by 0.3000 nat at token 1") for reason in divergence.reasons
    )
    loose = judge_divergence(cold, warm, Comparison(max_drift_nats=0.5))
    assert loose is not None and loose.kind is DivergenceKind.BENIGN


@pytest.mark.parametrize(("cold_length", "warm_length", "ended"), [(2, 3, "cold"), (3, 2, "warm")])
def test_one_side_longer_is_corruption_never_a_tie(cold_length: int, warm_length: int, ended: str) -> None:
    tokens = [*SHARED, confident(99)]
    divergence = judge_divergence(tokens[:cold_length], tokens[:warm_length], DEFAULT)
    assert divergence is not None and divergence.kind is DivergenceKind.CORRUPTION
    assert divergence.position == 2
    assert divergence.reasons == [
        f"the {ended} answer ends at token 2 where the {'warm' if ended == 'cold' else 'cold'} one goes on"
    ]


def test_a_divergence_at_the_last_token_is_judged() -> None:
    divergence = judge_divergence(
        [*SHARED, near_tie(IS, WAS, 0.02)], [*SHARED, near_tie(WAS, IS, 0.02)], DEFAULT
    )
    assert divergence is not None and divergence.position == 2 and divergence.kind is DivergenceKind.BENIGN


# --- class 1: identical tokens, moved distribution ---------------------------------------------------


def test_identical_tokens_over_a_distribution_moved_by_whole_nats_are_corruption() -> None:
    cold = [confident(token, -0.01) for token in (1, 2, 3)]
    warm = [confident(token, -1.61, runner_up=-6.6) for token in (1, 2, 3)]
    judgement = judge_tokens(cold, warm, DEFAULT)
    assert judgement.divergence is None
    assert judgement.evidence.max_drift_nats == pytest.approx(1.6)
    assert judgement.drift_problem is not None
    assert judgement.drift_problem.startswith("the distributions moved by 1.6000 nat at token 0")


# --- class 2: drift hidden in the runner-ups ----------------------------------------------------------


def _saturated(runner_up: float, *, listed: bool) -> TokenLogprob:
    """A confident token whose runner-up (id 50) is at `runner_up`; `listed`: inside the top-5."""
    rest = [(60, -7.0), (61, -7.5), (62, -8.0)]
    top = (
        [(7, -0.0005 if runner_up < -5 else -0.05), (50, runner_up), *rest]
        if listed
        else [(7, -0.0005), *rest, (63, -8.5)]
    )
    return tok(7, top[0][1], *top)


def test_a_runner_up_that_rose_from_outside_the_top_list_is_bounded_drift() -> None:
    """Cold: the runner-up sits at -9, below the top-5 (whose last entry is -8.5); warm: it is at -3.5.
    The sampled token barely moves (-0.0005 -> -0.05): only the union of the lists shows it."""
    cold = [_saturated(-9.0, listed=False)] * 3
    warm = [_saturated(-3.5, listed=True)] * 3
    judgement = judge_tokens(cold, warm, DEFAULT)
    assert judgement.divergence is None
    assert judgement.evidence.drift_bounded is True and judgement.evidence.drift_token_id == 50
    assert judgement.evidence.max_drift_nats == pytest.approx(5.0)  # -3.5 above the cold bound -8.5
    assert judgement.drift_problem is not None and "moved by at least 5.0000 nat" in judgement.drift_problem


def test_a_token_listed_on_one_side_below_the_other_sides_bound_is_no_evidence() -> None:
    cold = [tok(7, -0.01, (7, -0.01), (60, -7.0), (61, -7.5), (62, -8.0), (63, -8.5))]
    warm = [tok(7, -0.01, (7, -0.01), (60, -7.0), (61, -7.5), (62, -8.0), (64, -8.5))]
    judgement = judge_tokens(cold, warm, DEFAULT)
    assert judgement.drift_problem is None
    # 64 may sit at the cold list's last logprob, 63 at the warm's: a swap in the tail, no evidence.
    assert judgement.evidence.max_drift_nats == 0.0
    # Listed on one side above the other side's bound, it must have moved at least that far.
    above = [tok(7, -0.01, (7, -0.01), (60, -7.0), (61, -7.5), (62, -8.0), (64, -8.55))]
    bounded = judge_tokens(cold, above, DEFAULT).evidence
    assert bounded.drift_bounded and bounded.drift_token_id == 63
    assert bounded.max_drift_nats == pytest.approx(0.05)


# --- class 3: a flattened distribution at the divergence itself ---------------------------------------


def test_two_candidates_that_sank_together_are_no_tie() -> None:
    cold = [*SHARED, near_tie(IS, WAS, 0.02)]
    warm = [*SHARED, near_tie(WAS, IS, 0.02, shift=1.8)]
    divergence = judge_divergence(cold, warm, DEFAULT)
    assert divergence is not None and divergence.kind is DivergenceKind.CORRUPTION
    assert divergence.cold_token_drift_nats == pytest.approx(1.82)
    assert divergence.warm_token_drift_nats == pytest.approx(1.78)
    assert any("the cold answer's token moved by 1.8200 nat" in reason for reason in divergence.reasons)
    assert any("a tie of two sunken tokens is no tie" in reason for reason in divergence.reasons)


def test_exact_mode_fails_identical_tokens_over_a_moved_distribution_too() -> None:
    cold = answer("abc", [confident(1)])
    warm = answer("abc", [confident(1, -1.0, runner_up=-6.0)])
    result = compare_answers(cold, warm, Comparison(mode=ComparisonMode.EXACT))
    assert result.failures and "moved by 1.0000 nat at token 0 (token_id:80)" in result.failures[0]


# --- comparing answers ------------------------------------------------------------------------------


def answer(
    text: str | None,
    logprobs: list[TokenLogprob] | None,
    prompt_tokens: int = 10,
    *,
    reasoning: str | None = None,
    completion_tokens: int | None = -1,
    problem: str | None = None,
) -> ChatAnswer:
    count = len(logprobs) if logprobs is not None and completion_tokens == -1 else completion_tokens
    return ChatAnswer(
        url="http://a",
        status=200,
        text=text,
        reasoning=reasoning,
        prompt_tokens=prompt_tokens,
        completion_tokens=None if count == -1 else count,
        logprobs=logprobs,
        logprobs_problem=problem,
    )


BENIGN_COLD = [*SHARED, near_tie(IS, WAS, 0.05)]
BENIGN_WARM = [*SHARED, near_tie(WAS, IS, 0.05)]


def test_a_benign_divergence_passes_when_the_texts_agree_over_the_shared_tokens() -> None:
    cold = answer("The answer is", BENIGN_COLD)
    warm = answer("The answer was", BENIGN_WARM)
    result = compare_answers(cold, warm, DEFAULT, SharedText(tokens=2, text="The answer"))
    assert result.failures == [] and result.unjudged == []
    assert result.divergence is not None and result.divergence.kind is DivergenceKind.BENIGN
    assert result.mismatch is not None  # the text differs, and is shown
    assert result.notes[0].startswith("passed over a benign divergence at token 2")


def test_text_that_differs_before_the_divergence_fails_whatever_the_tie() -> None:
    """Class 5: the ids agree up to the tie, the texts do not: the text is not what the ids say."""
    cold = answer("The answer is", BENIGN_COLD)
    warm = answer("The bnswer was", BENIGN_WARM)
    result = compare_answers(cold, warm, DEFAULT, SharedText(tokens=2, text="The answer"))
    assert (
        result.failures
        and "the answers' texts differ at character 4, inside the text of the 2 tokens"
        in (result.failures[0])
    )


@pytest.mark.parametrize(
    ("shared", "why"),
    [
        (None, "was not decoded"),
        (
            SharedText(tokens=2, error="POST http://a/detokenize returned HTTP 404"),
            "could not be decoded (POST",
        ),
        (SharedText(tokens=1, text="The"), "was not decoded"),  # decoded for another divergence
    ],
)
def test_a_benign_divergence_whose_shared_text_is_unknown_is_unjudged(
    shared: SharedText | None, why: str
) -> None:
    result = compare_answers(
        answer("The answer is", BENIGN_COLD), answer("The answer was", BENIGN_WARM), DEFAULT, shared
    )
    assert result.failures == [] and not result.proven_equal
    assert why in result.unjudged[0]


def test_byte_fallback_characters_are_different_ids_not_equal_replacement_characters() -> None:
    """Class 5: two CJK characters whose byte-fallback tokens each decode to U+FFFD alone. By id they
    differ at their first differing byte; a partial character at the end of the shared text is not
    demanded of both answers."""
    cold_ids, warm_ids = VOCAB.encode("区域"), VOCAB.encode("区城")
    first = next(i for i, (a, b) in enumerate(zip(cold_ids, warm_ids, strict=True)) if a != b)
    assert VOCAB.text(cold_ids[first]) == VOCAB.text(warm_ids[first]) == "\ufffd"
    shared = VOCAB.decode(cold_ids[:first])
    assert shared.endswith("\ufffd") and shared_prefix(shared) == "区"
    cold = [confident(token) for token in cold_ids]
    warm = [confident(token) for token in warm_ids]
    divergence = judge_divergence(cold, warm, DEFAULT)
    assert divergence is not None and divergence.position == first
    assert divergence.kind is DivergenceKind.CORRUPTION  # confident tokens: no tie to excuse it


def test_the_reasoning_markers_a_parser_removes_are_not_demanded_of_the_text() -> None:
    assert shared_prefix("think</think>\n\n{") == "think\n\n{"
    assert shared_prefix("<think>a") == "a"


@pytest.mark.parametrize("missing", ["cold", "warm"])
def test_differing_answers_without_logprobs_are_unjudged_not_passed(missing: str) -> None:
    cold = answer("The answer is", None if missing == "cold" else BENIGN_COLD)
    warm = answer("The answer was", None if missing == "warm" else BENIGN_COLD)
    result = compare_answers(cold, warm, DEFAULT)
    assert result.failures == []
    assert result.divergence is not None and result.divergence.kind is DivergenceKind.UNJUDGED
    assert f"the {missing} answer sent no logprobs" in result.unjudged[0]


def test_equal_answers_without_logprobs_are_unjudged_never_passed() -> None:
    """Equal text shows neither equal tokens (class 5) nor equal distributions (class 1)."""
    result = compare_answers(answer("same", None), answer("same", None), DEFAULT)
    assert result.failures == [] and result.divergence is None and not result.proven_equal
    assert result.unjudged[0].startswith("the answers' texts are equal, but equal text shows neither")
    assert "the cold answer sent no logprobs" in result.unjudged[0]


@pytest.mark.parametrize(
    ("cold", "message"),
    [
        (
            answer("same", None, problem="logprobs.content[0].token is 'a', not a token id"),
            "cannot be judged: ",
        ),
        (answer("same", SHARED, completion_tokens=3), "cover 2 tokens but its usage counts 3"),
        (answer("same", SHARED, completion_tokens=None), "has no usage.completion_tokens"),
    ],
)
def test_logprobs_that_are_not_ids_or_do_not_cover_the_answer_are_unjudged(
    cold: ChatAnswer, message: str
) -> None:
    result = compare_answers(cold, answer("same", SHARED), DEFAULT)
    assert not result.proven_equal and result.failures == []
    assert message in result.unjudged[0]


def test_identical_ids_with_different_text_or_reasoning_fail() -> None:
    result = compare_answers(answer("a", SHARED), answer("b", SHARED), DEFAULT)
    assert result.failures[0].endswith("although the token ids are identical")
    reasoning = compare_answers(
        answer(None, SHARED, reasoning="x"), answer(None, SHARED, reasoning="y"), DEFAULT
    )
    assert reasoning.failures[0].startswith("warm reasoning differs from the cold one at character 0")


def test_exact_mode_fails_the_same_benign_divergence() -> None:
    cold = answer("The answer is", BENIGN_COLD)
    warm = answer("The answer was", BENIGN_WARM)
    result = compare_answers(cold, warm, Comparison(mode=ComparisonMode.EXACT))
    assert result.divergence is not None
    assert result.failures[0].startswith(
        "warm answer diverges from the cold one (exact comparison: no divergence allowed)"
    )


# --- parsing ----------------------------------------------------------------------------------------


def entry(token: Any = "token_id:1", logprob: Any = -0.1, top: Any = None, size: int = 5) -> dict[str, Any]:
    if top is None:
        top = [{"token": token, "logprob": logprob}] + [
            {"token": f"token_id:{100 + i}", "logprob": -5.0 - i} for i in range(size - 1)
        ]
    return {"token": token, "logprob": logprob, "top_logprobs": top}


def test_vllm_shaped_logprobs_parse_by_token_id() -> None:
    parsed = parse_logprobs(answer_logprobs("Hello world.", 5), top_k=5, max_entries=80)
    assert parsed is not None
    assert [item.token_id for item in parsed] == VOCAB.encode("Hello world.")
    assert all(len(item.top) == 5 and item.top[0].token_id == item.token_id for item in parsed)


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
        ({"content": [entry(size=6)]}, "has 6 entries, more than the 5 asked"),
        (
            {
                "content": [
                    entry(
                        top=[
                            {"token": "token_id:1", "logprob": -0.1},
                            {"token": "token_id:2", "logprob": -3.0},
                            {"token": "token_id:3", "logprob": -1.0},
                        ],
                    )
                ]
            },
            "is not sorted by logprob, descending",
        ),
        (
            {
                "content": [
                    entry(
                        top=[{"token": "token_id:1", "logprob": -0.1}, {"token": "token_id:2", "logprob": -2}]
                        * 2
                    )
                ]
            },
            "repeats token_id:1",
        ),
        (
            {"content": [entry(top=[{"token": "token_id:1", "logprob": -0.5}])]},
            "the sampled token_id:1 has logprob -0.1 but -0.5 in its top list",
        ),
        (
            {"content": [entry(top=[{"token": "token_id:2", "logprob": math.nan}])]},
            "top_logprobs[0].logprob is nan",
        ),
        ({"content": "abc"}, "logprobs.content is str, not a list"),
        ({"content": [5]}, "logprobs.content[0] is int, not an object"),
        ("abc", "logprobs is str"),
        ({"content": [entry(top="x")]}, "top_logprobs is str, not a list"),
        # Malformed outranks unusable: a text token earlier does not hide an impossible number later.
        ({"content": [entry(token="a"), entry(logprob=1.0)]}, "logprob is 1.0"),
    ],
)
def test_malformed_logprobs_are_refused(raw: Any, message: str) -> None:
    with pytest.raises(LogprobsError) as caught:
        parse_logprobs(raw, top_k=5, max_entries=10)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"content": [entry(token="a")]}, "token is 'a', not a token id (token_id:N)"),
        ({"content": [entry(size=3)]}, "has 3 entries, fewer than the 5 asked"),
        ({"content": [entry(top=[])]}, "has 0 entries, fewer than the 5 asked"),
    ],
)
def test_logprobs_without_ids_or_with_short_top_lists_are_unusable(raw: Any, message: str) -> None:
    with pytest.raises(LogprobsUnusable) as caught:
        parse_logprobs(raw, top_k=5, max_entries=10)
    assert message in str(caught.value)


def test_a_sampled_token_leading_an_otherwise_sorted_list_is_vllms_layout() -> None:
    top = [
        {"token": "token_id:3", "logprob": -2.0},
        {"token": "token_id:1", "logprob": -0.1},
        {"token": "token_id:2", "logprob": -0.5},
    ]
    parsed = parse_logprobs({"content": [entry("token_id:3", -2.0, top)]}, top_k=3, max_entries=None)
    assert parsed is not None and [item.token_id for item in parsed[0].top] == [3, 1, 2]


def _chat(payload: dict[str, Any]) -> ChatAnswer:
    response = httpx.Response(200, json=payload)
    return parse_chat_response("http://a", response, latency_s=0.0, attempts=1, top_logprobs=5, max_tokens=80)


def test_nan_logprobs_in_a_200_make_a_malformed_answer() -> None:
    payload = (
        '{"choices": [{"message": {"content": "a"}, "logprobs": {"content": '
        '[{"token": "token_id:1", "logprob": NaN, "top_logprobs": []}]}}], "usage": {"prompt_tokens": 3}}'
    )
    response = httpx.Response(200, text=payload, headers={"content-type": "application/json"})
    parsed = parse_chat_response(
        "http://a", response, latency_s=0.0, attempts=1, top_logprobs=5, max_tokens=80
    )
    assert parsed.error_kind is ErrorKind.MALFORMED
    assert parsed.error is not None and "impossible logprobs" in parsed.error and "nan" in parsed.error
    ignored = parse_chat_response("http://a", response, latency_s=0.0, attempts=1)
    assert ignored.ok and ignored.logprobs is None  # not asked for: not read


def test_text_tokens_make_an_answer_whose_logprobs_cannot_be_judged() -> None:
    parsed = _chat({"choices": [{"message": {"content": "a"}, "logprobs": {"content": [entry(token="a")]}}]})
    assert parsed.ok and parsed.logprobs is None
    assert parsed.logprobs_problem is not None and "not a token id" in parsed.logprobs_problem


SPEC = {
    "mean_acceptance_length": 2.0,
    "draft_acceptance_rate": 1 / 3,
    "acceptance_histogram": [0, 2, 0, 0],
    "num_spec_steps": 2,
    "num_accepted_draft_tokens": 2,
    "num_draft_tokens": 6,
    "num_spec_tokens": 3,
}
MESSAGE = {"choices": [{"message": {"content": "a"}}]}


def test_per_request_evidence_parses() -> None:
    usage = {"prompt_tokens": 185, "completion_tokens": 10, "prompt_tokens_details": {"cached_tokens": 128}}
    parsed = _chat({**MESSAGE, "usage": usage, "metrics": {"speculative_decoding": SPEC}})
    assert parsed.ok and parsed.cached_tokens == 128 and parsed.completion_tokens == 10
    assert parsed.spec_decoding is not None and parsed.spec_decoding.num_draft_tokens == 6
    bare = _chat({**MESSAGE, "usage": {"prompt_tokens": 185}, "metrics": {"speculative_decoding": None}})
    assert bare.ok and bare.cached_tokens is None and bare.spec_decoding is None  # absent: no evidence


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 11}}},
            "more than the prompt's 10",
        ),
        (
            {"usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": "5"}}},
            "'5', not a count",
        ),
        (
            {"usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": True}}},
            "True, not a count",
        ),
        ({"usage": {"prompt_tokens": -1}}, "usage.prompt_tokens: -1, not a count"),
        ({"usage": {"prompt_tokens": 10, "completion_tokens": 81}}, "more than the 80 asked for"),
        ({"usage": {"prompt_tokens": 2**40}}, "not a count"),
        ({"usage": "x"}, "usage: str, not an object"),
        ({"usage": {"prompt_tokens": 5, "prompt_tokens_details": 3}}, "prompt_tokens_details: int"),
        (
            {"metrics": {"speculative_decoding": {**SPEC, "num_spec_steps": 3}}},
            "the histogram counts 2 steps",
        ),
        ({"metrics": {"speculative_decoding": {**SPEC, "num_accepted_draft_tokens": 5}}}, "disagrees with"),
        (
            {"metrics": {"speculative_decoding": {**SPEC, "num_draft_tokens": 1}}},
            "2 accepted of 1 drafted over 2 steps of 3",
        ),
        (
            {"metrics": {"speculative_decoding": {**SPEC, "draft_acceptance_rate": "x"}}},
            "not a finite number",
        ),
        ({"metrics": {"speculative_decoding": {**SPEC, "acceptance_histogram": [1, 1]}}}, "not 4 counts"),
        ({"metrics": {"speculative_decoding": {**SPEC, "num_draft_tokens": None}}}, "no num_draft_tokens"),
        (
            {
                "usage": {"prompt_tokens": 5, "completion_tokens": 1},
                "metrics": {"speculative_decoding": SPEC},
            },
            "2 verify steps for 1 answer tokens",
        ),
        ({"metrics": []}, "metrics: list, not an object"),
    ],
)
def test_impossible_per_request_evidence_is_malformed(fields: dict[str, Any], message: str) -> None:
    parsed = _chat({**MESSAGE, **fields})
    assert parsed.error_kind is ErrorKind.MALFORMED
    assert parsed.error is not None and message in parsed.error


def test_null_content_beside_reasoning_is_an_answer_and_without_it_malformed() -> None:
    reasoning = _chat(
        {"choices": [{"message": {"content": None, "reasoning": "thinking"}, "finish_reason": "length"}]}
    )
    assert (
        reasoning.ok and reasoning.text is None and reasoning.reasoning == "thinking" and reasoning.truncated
    )
    older = _chat({"choices": [{"message": {"content": None, "reasoning": None, "reasoning_content": "t"}}]})
    assert older.ok and older.reasoning == "t"
    nothing = _chat({"choices": [{"message": {"content": None}}]})
    assert nothing.error_kind is ErrorKind.MALFORMED


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
    with pytest.raises(ValueError, match="must not set 'return_tokens_as_token_ids'"):
        CanaryConfig(
            replicas=["http://a:1", "http://b:1"],
            request={"messages": [{"role": "user", "content": "x"}], "return_tokens_as_token_ids": False},
        )


def test_suite_names_are_distinct_and_the_default_needs_a_block_size() -> None:
    entry_ = SuiteEntry(name="x", request={"messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(ValueError, match="distinct"):
        CanaryConfig(replicas=["http://a:1", "http://b:1"], suite=[entry_, entry_])
    with pytest.raises(ValueError, match="the default suite needs block_size"):
        CanaryConfig(replicas=["http://a:1", "http://b:1"], suite="default")


def _tie_at_the_end(choose: str, other: str, gap: float) -> Any:
    """A payload filter: the answer's last token becomes `choose`, a near tie `gap` nat above `other`,
    and the content the text of the ids."""
    chosen, runner_up = VOCAB.word(choose), VOCAB.word(other)

    def rewrite(payload: dict[str, Any]) -> dict[str, Any]:
        choice = payload["choices"][0]
        content = choice["logprobs"]["content"]
        last = content[-1]
        top = [
            {"token": f"token_id:{chosen}", "logprob": -0.7},
            {"token": f"token_id:{runner_up}", "logprob": -0.7 - gap},
        ]
        top += [{"token": f"token_id:{900 + i}", "logprob": -5.0 - i} for i in range(3)]
        content[-1] = {**last, "token": f"token_id:{chosen}", "logprob": -0.7, "top_logprobs": top}
        ids = [int(item["token"].split(":")[1]) for item in content]
        choice["message"]["content"] = VOCAB.decode(ids)
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
        decoded = cluster[0].requests_to("/detokenize")
    [pair] = result.pairs
    assert pair.verdict is verdict, pair.reasons
    assert pair.divergence is not None
    assert (pair.divergence.cold_token_id, pair.divergence.warm_token_id) == (
        VOCAB.word("."),
        VOCAB.word("!"),
    )
    assert pair.divergence.cold_gap_nats == pytest.approx(gap)
    table = render_table(result)
    assert f"{pair.divergence.kind.value}@{pair.divergence.position} gap {gap:.3f}" in table
    assert "divergence: " in table
    assert json.loads(render_json(result))["pairs"][0]["divergence"]["kind"] == pair.divergence.kind.value
    if verdict is Verdict.PASSED:
        # The writer decoded the shared tokens once, and both texts agree over them.
        assert len(decoded) == 1 and decoded[0].body is not None
        assert len(decoded[0].body["tokens"]) == pair.divergence.position
        assert pair.shared_text is not None and pair.shared_text.text is not None
        assert pair.cold is not None and pair.cold.text is not None
        assert pair.cold.text.startswith(pair.shared_text.text)
        assert pair.notes[0].startswith("passed over a benign divergence")
        assert (
            "parts from it at a benign near tie (1 of them; pair 0: benign divergence at token"
            in result.reason
        )
        assert result.cost.detokenize_requests == 1
    else:
        assert decoded == []  # a corruption needs no text check


async def test_a_writer_that_cannot_decode_the_shared_tokens_leaves_a_benign_tie_unjudged() -> None:
    with FakeCluster.start(2) as cluster:
        cluster[0].payload_filter = _tie_at_the_end(".", "!", 0.05)
        cluster[1].payload_filter = _tie_at_the_end("!", ".", 0.05)
        cluster[0].detokenize_status = 500
        config = CanaryConfig(
            replicas=cluster.urls, request=PLAIN, expectations=[], block_size=32, eagle=True, pairs="first"
        )
        result = await run_canary(config)
    [pair] = result.pairs
    assert pair.verdict is Verdict.INCONCLUSIVE
    assert (
        "could not be decoded (POST" in pair.reasons[0] and "/detokenize returned HTTP 500" in pair.reasons[0]
    )


async def test_exact_mode_asks_for_logprobs_by_id_and_fails_a_changed_text() -> None:
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
        sent = cluster[0].requests_to("/v1/chat/completions")[0].body
    [pair] = result.pairs
    assert sent is not None and sent["return_tokens_as_token_ids"] is True and sent["logprobs"] is True
    assert pair.cold is not None and pair.cold.logprobs is not None  # asked for in exact mode too
    assert pair.verdict is Verdict.FAILED
    assert pair.reasons[0].startswith("warm answer differs from the cold one at character 0")
    assert pair.reasons[0].endswith("although the token ids are identical")
