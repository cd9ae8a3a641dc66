"""Issue 31's classes, each against fake replicas that lie in that way
(tests/support/adversarial_replicas.py), through `run_canary` and the CLI: the verdict and its cause.
Healthy neighbours must pass."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tests.support.adversarial_replicas import (
    BenignNoise,
    BenignTie,
    ByteFallbackLie,
    ColdClaimsCached,
    DraftsWithoutDrafting,
    DropsUsage,
    FlattenedTie,
    HugeNumbers,
    LyingCachedTokens,
    MovedDistribution,
    NanLogprobs,
    RepeatedKey,
    RunnerUpDrift,
    SaltStripped,
    ShortTopLists,
    StripsLogprobs,
    TextTokens,
)
from tests.support.fake_vllm import FakeCluster, FakeReplica, Mode, OtherTraffic

from mooncake_operator.canary.models import CanaryConfig, CanaryResult, PairResult, PutWaitOutcome, Verdict
from mooncake_operator.canary.runner import run_canary
from mooncake_operator.cli.main import main

pytestmark = pytest.mark.unit

EAGLE_32: dict[str, Any] = {"block_size": 32, "eagle": True, "connect_retries": 0}


async def canary(cluster: FakeCluster, **options: Any) -> CanaryResult:
    return await run_canary(CanaryConfig(replicas=cluster.urls, **{**EAGLE_32, **options}))


def start(kind: type[FakeReplica], *, reader_only: bool = False, **options: Any) -> Any:
    """Two replicas of `kind` (or a correct writer and a `kind` reader)."""
    kinds = [FakeReplica, kind] if reader_only else [kind, kind]
    return FakeCluster.start(2, kinds=kinds, **options)


def reasons(pair: PairResult) -> str:
    return " | ".join(pair.reasons)


# --- class 1: identical tokens, moved distribution ---------------------------------------------------


async def test_identical_tokens_over_a_moved_distribution_fail_on_every_pair() -> None:
    with start(MovedDistribution) as cluster:
        result = await canary(cluster, suite="default")
    assert result.verdict is Verdict.FAILED
    for pair in result.pairs:
        assert pair.verdict is Verdict.FAILED, pair.request_name
        assert pair.divergence is None  # greedy picked the same tokens
        assert (
            "the warm answer's token ids equal the cold one's, but the distributions moved by 1.6"
            in reasons(pair)
        )
        assert pair.logprob_evidence is not None and pair.logprob_evidence.max_drift_nats == pytest.approx(
            1.6
        )


async def test_identical_tokens_within_numerics_pass() -> None:
    with start(BenignNoise) as cluster:
        result = await canary(cluster, suite="default")
    assert result.verdict is Verdict.PASSED, result.reason
    assert all(
        p.logprob_evidence and p.logprob_evidence.max_drift_nats == pytest.approx(0.02) for p in result.pairs
    )


# --- class 2: drift hidden in the runner-ups -----------------------------------------------------------


async def test_a_runner_up_that_moved_from_outside_the_top_list_fails_the_suite_too() -> None:
    """The suite's requests carry no value checks: only the runner-ups' drift shows the corruption that
    the later near tie would otherwise excuse."""
    with start(RunnerUpDrift) as cluster:
        result = await canary(cluster, suite="default")
    assert result.verdict is Verdict.FAILED
    suite = [pair for pair in result.pairs if pair.request_name != "request"]
    assert suite and all(pair.verdict is Verdict.FAILED for pair in suite)
    for pair in suite:
        assert pair.expectation_violations == []  # superseded values in one JSON object: no check sees them
        assert "moved by at least 5.0000 nat" in reasons(pair), reasons(pair)
        assert pair.logprob_evidence is not None and pair.logprob_evidence.drift_bounded


# --- class 3: a flattened distribution at the divergence -----------------------------------------------


async def test_two_candidates_that_sank_together_at_token_zero_fail() -> None:
    with start(FlattenedTie) as cluster:
        result = await canary(cluster, suite="default")
    assert result.verdict is Verdict.FAILED
    for pair in result.pairs:
        assert pair.divergence is not None and pair.divergence.position == 0
        assert pair.divergence.kind == "corruption"
        assert pair.divergence.warm_gap_nats == pytest.approx(0.02)  # still a "tie" on the warm side
        assert "token moved by 1.8" in reasons(pair)


async def test_a_benign_near_tie_with_drift_under_the_bound_passes_and_is_reported() -> None:
    with start(BenignTie) as cluster:
        result = await canary(cluster, suite="default")
    assert result.verdict is Verdict.PASSED, result.reason
    for pair in result.pairs:
        assert pair.divergence is not None and pair.divergence.kind == "benign"
        assert pair.shared_text is not None and pair.shared_text.text  # checked against both texts
        assert any(note.startswith("passed over a benign divergence") for note in pair.notes)
    assert "benign near tie" in result.reason


# --- class 4: other users' traffic proves the canary's warm path ----------------------------------------


async def test_other_users_loads_never_prove_a_warm_request_that_loaded_nothing() -> None:
    busy = OtherTraffic(requests=2, prompt_tokens=200, external_hit_tokens=160, drafts=10)
    with FakeCluster.start(2, modes=[Mode.CORRECT, Mode.NEVER_LOADS], other_traffic=busy) as cluster:
        per_request = await canary(cluster, pairs="first")
        for replica in cluster:
            replica.prompt_tokens_details = False
            replica.per_request_spec_metrics = False
        counters_only = await canary(cluster, pairs="first")
    [pair] = per_request.pairs
    assert pair.verdict is Verdict.INCONCLUSIVE
    assert pair.external_hit_tokens == 320  # the counter rose: other users' hits
    assert "the warm answer reports 0 cached prompt tokens" in pair.reasons[0]
    [pair] = counters_only.pairs
    assert pair.verdict is Verdict.INCONCLUSIVE
    assert "cannot be attributed to it (it finished 3 requests in the window, the canary sent 1" in reasons(
        pair
    )
    assert "--enable-prompt-tokens-details" in reasons(pair)
    assert "--per-request-spec-decode-metrics summary" in reasons(pair)  # the drafts are other users' too


async def test_a_busy_reader_whose_users_hit_the_store_passes_on_the_pairs_own_evidence() -> None:
    busy = OtherTraffic(requests=3, prompt_tokens=300, external_hit_tokens=256, drafts=20)
    with FakeCluster.start(2, other_traffic=busy) as cluster:
        result = await canary(cluster, suite="default")
    assert result.verdict is Verdict.PASSED, result.reason
    assert all(pair.hit_evidence == "answer" for pair in result.pairs)
    assert all(
        (pair.external_hit_tokens or 0) > (pair.expected_external_hit_tokens or 0) for pair in result.pairs
    )


async def test_quiet_replicas_without_per_request_evidence_pass_on_attributable_counters() -> None:
    with FakeCluster.start(2, prompt_tokens_details=False, per_request_spec_metrics=False) as cluster:
        result = await canary(cluster)
    assert result.verdict is Verdict.PASSED, result.reason
    assert all(pair.hit_evidence == "counters" for pair in result.pairs)


async def test_a_page_without_the_request_counters_cannot_attribute_a_rise() -> None:
    def without_request_counters(page: str) -> str:
        return "\n".join(line for line in page.splitlines() if "request_success" not in line) + "\n"

    with FakeCluster.start(2, prompt_tokens_details=False, per_request_spec_metrics=False) as cluster:
        cluster[1].metrics_filter = without_request_counters
        result = await canary(cluster, pairs="first")
    assert result.verdict is Verdict.INCONCLUSIVE
    assert "the page has no vllm:request_success_total" in result.reason


async def test_cached_tokens_the_counters_contradict_are_inconclusive() -> None:
    with FakeCluster.start(
        2, modes=[Mode.CORRECT, Mode.NEVER_LOADS], kinds=[FakeReplica, LyingCachedTokens]
    ) as cluster:
        result = await canary(cluster, pairs="first")
    [pair] = result.pairs
    assert pair.verdict is Verdict.INCONCLUSIVE
    assert (
        "reports 128 cached prompt tokens but the reader's prefix-cache counters rose by only 0"
        in reasons(pair)
    )


async def test_drafts_in_the_answer_with_flat_eagle_counters_are_inconclusive() -> None:
    with start(DraftsWithoutDrafting, reader_only=True) as cluster:
        result = await canary(cluster, pairs="first")
    [pair] = result.pairs
    assert pair.verdict is Verdict.INCONCLUSIVE
    assert (
        "the warm answer reports 12 draft tokens but the reader's "
        "vllm:spec_decode_num_draft_tokens_total rose by 0" in reasons(pair)
    )


async def test_a_warm_answer_without_drafts_is_inconclusive_with_eagle() -> None:
    with FakeCluster.start(2) as cluster:
        cluster[1].spec_decode_runs = False
        result = await canary(cluster, pairs="first")
    assert result.verdict is Verdict.INCONCLUSIVE
    assert "did not rise over the warm request" in result.reason


# --- class 5: text that differs before the first differing token -----------------------------------------


async def test_text_that_the_shared_ids_do_not_explain_fails_whatever_the_tie() -> None:
    request = {"model": "MiniMaxAI/MiniMax-M2.5", "messages": [{"role": "user", "content": "region? " * 60}]}
    with start(ByteFallbackLie) as cluster:
        result = await canary(cluster, request=request, expectations=[])
    assert result.verdict is Verdict.FAILED
    for pair in result.pairs:
        assert pair.divergence is not None and pair.divergence.kind == "benign"  # the tie alone looks fine
        assert "the answers' texts differ at character 13, inside the text of the" in reasons(pair)


async def test_tokens_as_text_cannot_be_compared_and_are_never_passed() -> None:
    with start(TextTokens) as cluster:
        result = await canary(cluster, pairs="first")
    assert result.verdict is Verdict.INCONCLUSIVE
    assert "not a token id (token_id:N)" in result.reason


# --- class 6: the writer was not cold ---------------------------------------------------------------------


@pytest.mark.parametrize("per_request", [True, False])
async def test_a_writer_that_loaded_the_previous_runs_prefix_is_no_reference(per_request: bool) -> None:
    """A proxy strips cache_salt: the second run's cold request loads the first run's prefix through the
    same buggy code as its reader, and both answers agree on the same wrong values."""
    options: dict[str, Any] = (
        {} if per_request else {"prompt_tokens_details": False, "per_request_spec_metrics": False}
    )
    with FakeCluster.start(4, modes=[Mode.US_EAST] * 4, kinds=[SaltStripped] * 4, **options) as cluster:
        await run_canary(CanaryConfig(replicas=cluster.urls[:2], pairs="first", expectations=[], **EAGLE_32))
        result = await run_canary(
            CanaryConfig(replicas=cluster.urls[2:], pairs="first", expectations=[], **EAGLE_32)
        )
    [pair] = result.pairs
    assert pair.cold is not None and pair.warm is not None
    assert pair.cold.text == pair.warm.text and "us-east" in (pair.cold.text or "")  # equal, and wrong
    assert pair.verdict is Verdict.INCONCLUSIVE and not pair.only_load_unproven
    if per_request:
        assert "the cold answer reports 128 cached prompt tokens despite a fresh cache_salt" in reasons(pair)
    else:
        assert (
            "the cold request hit 128 cached prompt tokens on the writer (external 128, local 0)"
            in reasons(pair)
        )


async def test_a_cold_answer_that_reports_cached_tokens_is_no_reference() -> None:
    with start(ColdClaimsCached) as cluster:
        result = await canary(cluster, pairs="first")
    [pair] = result.pairs
    assert pair.verdict is Verdict.INCONCLUSIVE and not pair.only_load_unproven
    assert "the cold answer reports 64 cached prompt tokens despite a fresh cache_salt" in reasons(pair)


async def test_without_any_cold_evidence_the_reference_is_unproven() -> None:
    with FakeCluster.start(2, prompt_tokens_details=False, per_request_spec_metrics=False) as cluster:
        cluster[0].mode = Mode.NO_METRICS
        result = await canary(cluster, pairs="first")
    [pair] = result.pairs
    assert pair.verdict is Verdict.INCONCLUSIVE
    assert "whether the cold answer was computed cold cannot be shown" in reasons(pair)


# --- class 7: a repeated JSON key -------------------------------------------------------------------------


async def test_a_repeated_key_with_the_superseded_value_first_fails() -> None:
    with start(RepeatedKey) as cluster:
        result = await canary(cluster, pairs="first")
    [pair] = result.pairs
    assert pair.verdict is Verdict.FAILED
    assert any('repeats the key \'region\' ("us-east", "us-west")' in v for v in pair.expectation_violations)
    assert 'cold answer: the JSON object holds the excluded value "us-east"' in pair.expectation_violations


# --- class 8: failed loads recomputed ---------------------------------------------------------------------


async def test_failed_loads_recomputed_are_never_a_proven_load() -> None:
    with FakeCluster.start(2, modes=[Mode.CORRECT, Mode.LOAD_FAILS_RECOMPUTE]) as cluster:
        result = await canary(cluster, pairs="first")
    [pair] = result.pairs
    assert pair.warm is not None and pair.warm.cached_tokens == 128  # counted at scheduling anyway
    assert pair.verdict is Verdict.INCONCLUSIVE
    assert "the reader failed to load 4 store keys (load_get) during the warm request" in reasons(pair)


# --- class 9: reasoning models ----------------------------------------------------------------------------


@pytest.mark.parametrize("reasoning", ["parser", "raw"])
async def test_a_reasoning_model_passes_patched_with_and_without_a_parser(reasoning: str) -> None:
    with FakeCluster.start(2, reasoning=reasoning) as cluster:
        result = await canary(cluster, suite="default")
    assert result.verdict is Verdict.PASSED, result.reason
    primary = result.pairs[0]
    assert primary.cold is not None and primary.cold.finish_reason == "stop"
    suite = [pair for pair in result.pairs if pair.request_name != "request"]
    # The suite's 32-token budget ends inside the reasoning: judged on tokens alone.
    assert all(pair.cold is not None and pair.cold.truncated for pair in suite)
    if reasoning == "parser":
        assert all(pair.cold is not None and pair.cold.text is None for pair in suite)


@pytest.mark.parametrize("reasoning", ["parser", "raw"])
async def test_a_reasoning_model_fails_buggy(reasoning: str) -> None:
    with FakeCluster.start(2, modes=[Mode.CORRECT, Mode.US_EAST], reasoning=reasoning) as cluster:
        result = await canary(cluster, pairs="first")
    [pair] = result.pairs
    assert pair.verdict is Verdict.FAILED
    assert 'warm answer: the JSON object holds the excluded value "us-east"' in pair.expectation_violations
    # The reasoning names us-east too, and is not judged by the content checks.
    assert not any(v.startswith("cold answer") for v in pair.expectation_violations)


async def test_an_answer_cut_inside_the_reasoning_leaves_its_content_checks_unjudged() -> None:
    from mooncake_operator.canary.request import reference_request

    with FakeCluster.start(2, reasoning="parser") as cluster:
        result = await canary(cluster, pairs="first", request={**reference_request(), "max_tokens": 10})
    [pair] = result.pairs
    assert pair.verdict is Verdict.INCONCLUSIVE and not pair.only_load_unproven
    assert "stopped at its token budget (finish_reason length) before it ended" in reasons(pair)


# --- class 10: the writer's asynchronous put ------------------------------------------------------------


async def test_the_canary_waits_for_the_writers_puts() -> None:
    with FakeCluster.start(2, put_delay_s=0.3) as cluster:
        waited = await canary(cluster, pairs="first", put_wait_s=5)
        hurried = await canary(cluster, pairs="first", put_wait_s=0)
    [pair] = waited.pairs
    assert waited.verdict is Verdict.PASSED, waited.reason
    assert pair.put_wait is not None and pair.put_wait.outcome is PutWaitOutcome.COVERED
    assert 0.25 <= pair.put_wait.waited_s < 5 and pair.put_wait.keys_reported == 5
    assert waited.cost.put_wait_s == pytest.approx(pair.put_wait.waited_s)
    [pair] = hurried.pairs
    assert hurried.verdict is Verdict.INCONCLUSIVE
    assert "the warm request was sent without waiting for the writer's store puts (put wait 0)" in reasons(
        pair
    )


async def test_puts_that_never_arrive_are_inconclusive_naming_the_wait() -> None:
    with FakeCluster.start(2, puts="never") as cluster:
        result = await canary(cluster, pairs="first", put_wait_s=0.3)
    [pair] = result.pairs
    assert pair.verdict is Verdict.INCONCLUSIVE
    assert pair.put_wait is not None and pair.put_wait.outcome is PutWaitOutcome.TIMEOUT
    assert pair.put_wait.waited_s >= 0.3
    assert "the writer had not reported store puts covering the prompt when the warm request was sent" in (
        reasons(pair)
    )


async def test_failed_puts_end_the_wait_and_explain_the_miss() -> None:
    with FakeCluster.start(2, puts="fail") as cluster:
        result = await canary(cluster, pairs="first", put_wait_s=60)
    [pair] = result.pairs
    assert pair.verdict is Verdict.INCONCLUSIVE
    assert pair.put_wait is not None and pair.put_wait.outcome is PutWaitOutcome.FAILED
    assert pair.put_wait.waited_s < 10  # ended by the failure, far from the 60 s allowed
    assert "the writer's store rejected 5 of the 5 keys it tried to save" in reasons(pair)


async def test_a_writer_without_store_metrics_is_not_waited_for() -> None:
    def without_store(page: str) -> str:
        return "\n".join(line for line in page.splitlines() if "mooncake_store" not in line) + "\n"

    # The put lands 20 s after the cold answer and the wait would allow 60: a canary that waited at
    # all shows 20 s or more, one that did not shows one metrics read (far from either, however busy
    # the machine).
    with FakeCluster.start(2, put_delay_s=20) as cluster:
        cluster[0].metrics_filter = without_store
        result = await canary(cluster, pairs="first", put_wait_s=60)
    [pair] = result.pairs
    assert pair.put_wait is not None and pair.put_wait.outcome is PutWaitOutcome.NO_STORE_METRICS
    assert pair.put_wait.waited_s < 10
    assert "the writer's metrics declare no Mooncake store counters" in reasons(pair)


# --- malformed and stripped evidence ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "verdict", "cause"),
    [
        (
            HugeNumbers,
            Verdict.FAILED,
            "impossible usage.prompt_tokens_details.cached_tokens: 1000000000000000",
        ),
        (NanLogprobs, Verdict.FAILED, "impossible logprobs: logprobs.content[1].logprob is nan"),
        (ShortTopLists, Verdict.INCONCLUSIVE, "has 3 entries, fewer than the 5 asked"),
        (StripsLogprobs, Verdict.INCONCLUSIVE, "the warm answer sent no logprobs"),
        (DropsUsage, Verdict.INCONCLUSIVE, "has no usage.completion_tokens"),
    ],
)
async def test_malformed_or_stripped_evidence_on_the_reader(
    kind: type[FakeReplica], verdict: Verdict, cause: str
) -> None:
    with start(kind, reader_only=kind is not DropsUsage) as cluster:
        result = await canary(cluster, pairs="first")
    [pair] = result.pairs
    assert pair.verdict is verdict, reasons(pair)
    assert cause in reasons(pair)


async def test_http_500_fails() -> None:
    with FakeCluster.start(2, modes=[Mode.CORRECT, Mode.HTTP_500]) as cluster:
        result = await canary(cluster, pairs="first")
    assert result.verdict is Verdict.FAILED
    assert "returned HTTP 500: EngineCore encountered an issue." in result.reason


# --- through the CLI ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "modes", "code", "cause"),
    [
        (MovedDistribution, None, 1, "the distributions moved by 1.6000 nat"),
        (FlattenedTie, None, 1, "a tie of two sunken tokens is no tie"),
        (FakeReplica, [Mode.CORRECT, Mode.LOAD_FAILS_RECOMPUTE], 2, "failed to load 4 store keys"),
        (BenignTie, None, 0, "benign near tie"),
    ],
)
def test_the_cli_gives_each_class_its_verdict_and_cause(
    kind: type[FakeReplica],
    modes: list[Mode] | None,
    code: int,
    cause: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with FakeCluster.start(2, modes=modes, kinds=[kind, kind]) as cluster:
        args = [argument for url in cluster.urls for argument in ("--replica", url)]
        exit_code = main(["canary", *args, "--block-size", "32", "--eagle", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert exit_code == code
    assert cause in result["reason"]
