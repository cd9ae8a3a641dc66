"""The canary as the operator runs it: config and verdict policy from the spec (`canary_policy`), when it
is due, blame, evidence (`decide.schedule`, `canary.status`)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from mooncake_operator.api.canary_spec import CanarySpec
from mooncake_operator.api.examples import reference_deployment
from mooncake_operator.api.spec import MooncakeServingSpec
from mooncake_operator.api.status import CanaryStatus, CanaryTarget
from mooncake_operator.canary import policy
from mooncake_operator.canary.defaults import DEFAULT_PUT_WAIT_S, MAX_PUT_WAIT_S
from mooncake_operator.canary.models import (
    CanaryResult,
    ChatAnswer,
    Comparison,
    ComparisonMode,
    Divergence,
    DivergenceKind,
    ErrorKind,
    Mismatch,
    PairResult,
    PutWait,
    PutWaitOutcome,
    SpecDecoding,
    Verdict,
)
from mooncake_operator.canary.request import reference_request
from mooncake_operator.canary.status import (
    benign_divergence_message,
    blamed_replicas,
    canary_status,
    format_time,
)
from mooncake_operator.reconcile.decide.canary_run import judge, not_run
from mooncake_operator.reconcile.decide.schedule import canary_due, current_target, interval_due_in

pytestmark = pytest.mark.unit

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
URLS = ["http://a:8000", "http://b:8000"]
PODS = ["x-replica-0", "x-replica-1"]


def spec_with(**canary: Any) -> MooncakeServingSpec:
    wire = reference_deployment().spec.to_wire()
    wire["canary"] = {**wire["canary"], **canary}
    return MooncakeServingSpec.model_validate(wire)


def target(**changes: Any) -> CanaryTarget:
    base: dict[str, Any] = {
        "revision": "r1",
        "generation": 1,
        "replica_pods": ["x-replica-0=u0", "x-replica-1=u1"],
        "master_pod": "m",
        "master_restarts": 0,
        "rerun": None,
    }
    return current_target(**{**base, **changes})


def last_run(verdict: str = "Passed", finished: datetime = NOW, **target_changes: Any) -> CanaryStatus:
    return CanaryStatus(
        run_id="run",
        verdict=verdict,
        finished_at=format_time(finished),
        target=target(**target_changes),
    )


def test_the_config_follows_the_spec() -> None:
    spec = reference_deployment().spec
    config = policy.canary_config(spec, URLS)
    assert config.replicas == URLS
    assert config.request == {**reference_request(), "model": spec.model.name}
    assert (config.block_size, config.eagle, config.pairs, config.request_timeout_s) == (
        16,
        True,
        "ring",
        300,
    )
    own = spec_with(
        request={"messages": [{"role": "user", "content": "hi"}]},
        expectations=[{"kind": "contains", "text": "hello"}],
        pairs="first",
    )
    config = policy.canary_config(own, URLS)
    assert config.request == {"messages": [{"role": "user", "content": "hi"}], "model": spec.model.name}
    assert [e.describe() for e in config.expectations] == [
        e.describe() for e in policy.canary_expectations(own) or []
    ]
    assert config.pairs == "first"
    assert policy.canary_config(spec_with(expectations=[]), URLS).expectations == []


def test_the_config_takes_the_body_caps_from_the_spec() -> None:
    capped = spec_with(maxChatBodyBytes=8 << 20, maxMetricsBodyBytes=32 << 20)
    config = policy.canary_config(capped, URLS)
    assert (config.max_chat_body_bytes, config.max_metrics_body_bytes) == (8 << 20, 32 << 20)
    default = policy.canary_config(spec_with(), URLS)
    assert (default.max_chat_body_bytes, default.max_metrics_body_bytes) == (4 << 20, 16 << 20)


def test_the_config_takes_the_put_wait_from_the_spec() -> None:
    assert policy.canary_config(spec_with(), URLS).put_wait_s == DEFAULT_PUT_WAIT_S
    assert policy.canary_config(spec_with(putWaitSeconds=42.5), URLS).put_wait_s == 42.5
    assert policy.canary_config(spec_with(putWaitSeconds=0), URLS).put_wait_s == 0  # off: at once


@pytest.mark.parametrize("value", [-1, -0.5, MAX_PUT_WAIT_S + 1, 86400, float("nan"), float("inf")])
def test_an_absurd_put_wait_is_refused_with_its_range(value: float) -> None:
    with pytest.raises(
        ValueError, match=r"canary.putWaitSeconds must be a number of seconds from 0 .* to 300"
    ):
        spec_with(putWaitSeconds=value)


@pytest.mark.parametrize("value", ["10", True, None])
def test_a_put_wait_that_is_not_a_number_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="putWaitSeconds"):
        spec_with(putWaitSeconds=value)


@pytest.mark.parametrize(
    ("last", "now_target", "expected"),
    [
        (None, target(), "no canary has run"),
        (last_run(), target(revision="r2"), "revision r2 is rolled out"),
        (last_run(), target(generation=2), "generation 2"),
        (
            last_run(),
            target(replica_pods=["x-replica-0=u9", "x-replica-1=u1"]),
            "replica pods replaced: x-replica-0",
        ),
        (last_run(), target(master_pod="m2"), "the store master restarted"),
        (last_run(), target(master_restarts=1), "the store master restarted"),
        (last_run(), target(rerun="again"), "re-run requested (again)"),
        (last_run(), target(), None),
    ],
)
def test_canary_due(last: CanaryStatus | None, now_target: CanaryTarget, expected: str | None) -> None:
    why = canary_due(last, now_target, now=NOW, interval_seconds=None, inconclusive_retry_seconds=60)
    assert (why is None) if expected is None else (why is not None and expected in why)


def test_interval_and_inconclusive_retry() -> None:
    earlier = NOW - timedelta(seconds=30)
    due = canary_due
    assert (
        due(last_run(finished=earlier), target(), now=NOW, interval_seconds=60, inconclusive_retry_seconds=60)
        is None
    )
    assert due(
        last_run(finished=earlier), target(), now=NOW, interval_seconds=30, inconclusive_retry_seconds=60
    ) == ("interval of 30s elapsed")
    inconclusive = last_run("Inconclusive", finished=earlier)
    assert due(inconclusive, target(), now=NOW, interval_seconds=None, inconclusive_retry_seconds=60) is None
    assert due(inconclusive, target(), now=NOW, interval_seconds=None, inconclusive_retry_seconds=20) == (
        "retrying an inconclusive run"
    )


def answer(url: str, text: str | None = '{"a": 1}', **changes: Any) -> ChatAnswer:
    return ChatAnswer(
        url=url, status=200 if text is not None else None, text=text, prompt_tokens=185, **changes
    )


def pair(index: int, verdict: Verdict, **changes: Any) -> PairResult:
    writer, reader = URLS[index], URLS[(index + 1) % 2]
    base: dict[str, Any] = {
        "index": index,
        "writer": writer,
        "reader": reader,
        "cache_salt": f"s{index}",
        "verdict": verdict,
        "reasons": [] if verdict is Verdict.PASSED else ["something"],
        "cold": answer(writer),
        "warm": answer(reader),
        "external_hit_tokens": 128,
        "expected_external_hit_tokens": 128,
        "answers_equal": verdict is Verdict.PASSED,
    }
    return PairResult(**{**base, **changes})


def result(*pairs: PairResult, verdict: Verdict = Verdict.FAILED) -> CanaryResult:
    return CanaryResult(
        run_id="run1",
        verdict=verdict,
        reason="why",
        replicas=URLS,
        pairs_mode="ring",
        pairs=list(pairs),
        expectations=[],
        started_at=NOW,
        wall_s=1.5,
        request_latency_s=1.0,
    )


def test_a_wrong_warm_answer_blames_the_reader() -> None:
    run = result(pair(0, Verdict.FAILED), pair(1, Verdict.PASSED))
    assert blamed_replicas(run, PODS) == ["x-replica-1"]


def test_a_failed_cold_request_blames_the_writer_only() -> None:
    cold = answer(URLS[1], None, error_kind=ErrorKind.HTTP_STATUS, error="HTTP 500")
    run = result(pair(0, Verdict.PASSED), pair(1, Verdict.FAILED, cold=cold, warm=None))
    assert blamed_replicas(run, PODS) == ["x-replica-1"]


def test_a_wrong_cold_answer_blames_both() -> None:
    run = result(pair(0, Verdict.FAILED, expectation_violations=["cold answer: x", "warm answer: x"]))
    assert blamed_replicas(run, PODS) == ["x-replica-0", "x-replica-1"]


def test_without_require_external_hit_equal_answers_pass() -> None:
    unproven = result(
        pair(0, Verdict.INCONCLUSIVE, answers_equal=True, only_load_unproven=True),
        pair(1, Verdict.PASSED),
        verdict=Verdict.INCONCLUSIVE,
    )
    assert policy.effective_verdict(unproven, require_external_hit=True) is Verdict.INCONCLUSIVE
    assert policy.effective_verdict(unproven, require_external_hit=False) is Verdict.PASSED
    unreachable = result(
        pair(0, Verdict.INCONCLUSIVE, answers_equal=None, connection_error="refused"),
        verdict=Verdict.INCONCLUSIVE,
    )
    assert policy.effective_verdict(unreachable, require_external_hit=False) is Verdict.INCONCLUSIVE
    failed = result(pair(0, Verdict.FAILED))
    assert policy.effective_verdict(failed, require_external_hit=False) is Verdict.FAILED


def test_the_status_names_replicas_by_pod_and_keeps_the_evidence() -> None:
    mismatch = Mismatch(position=12, cold='"us-west"', warm='"us-east"')
    failing = pair(0, Verdict.FAILED, mismatch=mismatch, load_get_keys=3, notes=["double prune"])
    cold, warm = failing.cold, failing.warm
    assert cold is not None and warm is not None
    failing = failing.model_copy(
        update={
            "cold": cold.model_copy(update={"latency_s": 0.8125}),
            "warm": warm.model_copy(update={"latency_s": 0.5}),
        }
    )
    status = canary_status(
        result(failing, pair(1, Verdict.PASSED, external_hit_tokens=-4)),
        verdict=Verdict.FAILED,
        target=target(),
        pod_names=PODS,
    )
    wire = status.to_wire()
    assert wire["finishedAt"] == "2026-01-01T12:00:01Z"
    assert wire["externalHitTokens"] == 124
    first = wire["pairs"][0]
    assert (first["writer"], first["reader"], first["verdict"]) == ("x-replica-0", "x-replica-1", "Failed")
    assert first["firstMismatch"] == {"position": 12, "cold": '"us-west"', "warm": '"us-east"'}
    assert (first["coldLatencyMs"], first["warmLatencyMs"], first["loadGetKeys"]) == (812.5, 500.0, 3)
    assert first["notes"] == ["double prune"]
    assert "externalHitTokens" not in wire["pairs"][1]  # a counter that went down is no evidence
    assert wire["target"]["revision"] == "r1"


def test_the_status_keeps_each_pairs_own_evidence() -> None:
    drafted = SpecDecoding(
        num_spec_steps=4, num_draft_tokens=12, num_accepted_draft_tokens=7, num_spec_tokens=3
    )
    proven = pair(0, Verdict.PASSED, hit_evidence="answer")
    cold, warm = proven.cold, proven.warm
    assert cold is not None and warm is not None
    proven = proven.model_copy(
        update={
            "cold": cold.model_copy(update={"cached_tokens": 0}),
            "warm": warm.model_copy(update={"cached_tokens": 112, "spec_decoding": drafted}),
            "put_wait": PutWait(outcome=PutWaitOutcome.COVERED, waited_s=0.0421, polls=2, keys_needed=8),
        }
    )
    unproven = pair(1, Verdict.INCONCLUSIVE)
    unproven = unproven.model_copy(
        update={"put_wait": PutWait(outcome=PutWaitOutcome.TIMEOUT, waited_s=10.0)}
    )
    status = canary_status(
        result(proven, unproven), verdict=Verdict.INCONCLUSIVE, target=target(), pod_names=PODS
    )
    first, second = status.to_wire()["pairs"]
    assert (first["warmCachedTokens"], first["coldCachedTokens"], first["warmDraftTokens"]) == (112, 0, 12)
    assert (first["hitEvidence"], first["putWait"], first["putWaitMs"]) == ("answer", "covered", 42.1)
    # Answers without per-request evidence leave it unset rather than 0 (0 cached tokens is evidence).
    assert not {"warmCachedTokens", "coldCachedTokens", "warmDraftTokens", "hitEvidence"} & set(second)
    assert (second["putWait"], second["putWaitMs"]) == ("timeout", 10000.0)
    # What the operator writes, it reads back (the outcome as the string it was written as).
    assert CanaryStatus.model_validate(status.to_wire()) == status


def test_the_config_takes_comparison_and_suite_from_the_spec() -> None:
    default = policy.canary_config(spec_with(), URLS)
    assert default.comparison == Comparison() and default.suite == "default"
    own = policy.canary_config(
        spec_with(
            comparison={"mode": "exact", "topK": 3, "maxTieGapNats": 0.2, "maxDriftNats": 0.05},
            suite=[{"name": "short", "request": {"messages": [{"role": "user", "content": "hi"}]}}],
        ),
        URLS,
    )
    assert own.comparison == Comparison(
        mode=ComparisonMode.EXACT, top_k=3, max_tie_gap_nats=0.2, max_drift_nats=0.05
    )
    assert isinstance(own.suite, list) and own.suite[0].name == "short"
    assert own.suite[0].request["model"] == reference_deployment().spec.model.name
    assert policy.canary_config(spec_with(suite=[]), URLS).suite == "off"


@pytest.mark.parametrize(
    ("canary", "message"),
    [
        ({"comparison": {"mode": "fuzzy"}}, "mode"),
        ({"comparison": {"topK": 21}}, "topK"),
        ({"comparison": {"maxTieGapNats": -1}}, "maxTieGapNats"),
        (
            {"suite": [{"name": "Bad Name", "request": {"messages": [{"role": "user", "content": "x"}]}}]},
            "name",
        ),
        (
            {
                "suite": [
                    {
                        "name": "x",
                        "request": {"messages": [{"role": "user", "content": "x"}], "logprobs": True},
                    }
                ]
            },
            "logprobs",
        ),
    ],
)
def test_bad_comparison_or_suite_specs_are_refused(canary: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec_with(**canary)


BENIGN = Divergence(
    position=3,
    cold_token=" is",
    warm_token=" was",
    kind=DivergenceKind.BENIGN,
    cold_gap_nats=0.05,
    warm_gap_nats=0.04,
    shared_tokens=3,
    max_drift_nats=0.01,
    top_k=5,
    max_tie_gap_nats_allowed=0.125,
    max_drift_nats_allowed=0.1,
)


def test_a_benign_divergence_is_in_the_status_and_the_event_message() -> None:
    run = result(
        pair(0, Verdict.PASSED, answers_equal=False, divergence=BENIGN, request_name="block-end"),
        pair(1, Verdict.PASSED),
        verdict=Verdict.PASSED,
    )
    status = canary_status(run, verdict=Verdict.PASSED, target=target(), pod_names=PODS)
    evidence = status.pairs[0].divergence
    assert evidence is not None and evidence.kind == "benign"
    assert (evidence.position, evidence.cold_token, evidence.warm_token) == (3, " is", " was")
    assert (evidence.cold_gap_nats, evidence.warm_gap_nats, evidence.max_drift_nats) == (0.05, 0.04, 0.01)
    assert status.pairs[0].request == "block-end"
    assert status.to_wire()["pairs"][0]["divergence"]["coldGapNats"] == 0.05
    message = benign_divergence_message(run, PODS)
    assert message is not None
    assert message.startswith(
        "run run1: 1 pair(s) passed over a benign divergence; block-end x-replica-0 -> x-replica-1"
    )
    assert "cold ' is', warm ' was'" in message
    assert benign_divergence_message(result(pair(0, Verdict.PASSED), verdict=Verdict.PASSED), PODS) is None


def test_without_require_external_hit_a_benign_divergence_counts_as_equal() -> None:
    unproven = result(
        pair(0, Verdict.INCONCLUSIVE, answers_equal=False, divergence=BENIGN, only_load_unproven=True),
        verdict=Verdict.INCONCLUSIVE,
    )
    assert policy.effective_verdict(unproven, require_external_hit=False) is Verdict.PASSED
    corrupt = BENIGN.model_copy(update={"kind": DivergenceKind.CORRUPTION})
    failing = result(
        pair(0, Verdict.INCONCLUSIVE, answers_equal=False, divergence=corrupt), verdict=Verdict.INCONCLUSIVE
    )
    assert policy.effective_verdict(failing, require_external_hit=False) is Verdict.INCONCLUSIVE


def test_the_canary_interval_is_due_counted_from_the_last_finished_run() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)

    def finished(seconds_ago: int) -> CanaryStatus:
        at = (now - timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")
        return CanaryStatus(run_id="r", verdict="Passed", finished_at=at)

    every_minute = CanarySpec(interval_seconds=60)
    assert interval_due_in(every_minute, finished(45), now) == 15
    assert interval_due_in(every_minute, finished(75), now) is None  # just handled
    assert interval_due_in(CanarySpec(), finished(45), now) is None
    assert interval_due_in(every_minute, None, now) is None
    assert interval_due_in(CanarySpec(enabled=False, interval_seconds=60), finished(45), now) is None


def test_a_finished_run_is_judged_under_the_specs_policy() -> None:
    """decide.canary_run.judge: the verdict the spec's policy records, the pods a failure blames, and the
    benign-divergence Event as an action; nothing blamed and no Event otherwise."""
    failed = judge(
        result(pair(0, Verdict.FAILED), pair(1, Verdict.PASSED)), spec_with(), target=target(), pod_names=PODS
    )
    assert (failed.canary.verdict, failed.blamed, failed.events) == ("Failed", ("x-replica-1",), ())
    unproven = result(
        pair(0, Verdict.INCONCLUSIVE, answers_equal=True, only_load_unproven=True),
        verdict=Verdict.INCONCLUSIVE,
    )
    lenient = judge(unproven, spec_with(requireExternalHit=False), target=target(), pod_names=PODS)
    assert (lenient.canary.verdict, lenient.blamed) == ("Passed", ())
    assert judge(unproven, spec_with(), target=target(), pod_names=PODS).canary.verdict == "Inconclusive"
    benign = result(
        pair(0, Verdict.PASSED, answers_equal=False, divergence=BENIGN),
        pair(1, Verdict.PASSED),
        verdict=Verdict.PASSED,
    )
    [event] = judge(benign, spec_with(), target=target(), pod_names=PODS).events
    assert (event.reason, event.type) == ("CanaryBenignDivergence", "Normal")
    assert event.message == benign_divergence_message(benign, PODS)


def test_a_run_that_could_not_run_is_inconclusive() -> None:
    run = not_run("no replica pod has an IP", run_id="not-run", now=NOW, target=target())
    assert (run.canary.verdict, run.canary.reason, run.blamed, run.events) == (
        "Inconclusive",
        "no replica pod has an IP",
        (),
        (),
    )
