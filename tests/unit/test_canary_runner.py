"""The canary against real HTTP servers on loopback that behave like vLLM replicas sharing a store."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from dataclasses import replace
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from tests.support.canary_evidence import measurement as _evidence
from tests.support.fake_vllm import CORRECT_ANSWER, PARAPHRASE, FakeCluster, Mode, answer_logprobs

from mooncake_operator.canary.client import RetryPolicy
from mooncake_operator.canary.models import (
    CanaryConfig,
    CanaryResult,
    ChatAnswer,
    ErrorKind,
    ExitCode,
    StoreCounters,
    Verdict,
)
from mooncake_operator.canary.request import reference_request
from mooncake_operator.canary.runner import PairMeasurement, judge_pair, plan_pairs, run_canary

pytestmark = pytest.mark.unit

EAGLE_32: dict[str, Any] = {"block_size": 32, "eagle": True}


async def canary(cluster: FakeCluster, **options: Any) -> CanaryResult:
    config = CanaryConfig(replicas=cluster.urls, connect_retries=0, **{**EAGLE_32, **options})
    return await run_canary(config)


def closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def test_correct_replicas_pass_every_ring_pair_with_the_exact_hit() -> None:
    with FakeCluster.start(3) as cluster:
        result = await canary(cluster)
    assert result.verdict is Verdict.PASSED, result.reason
    assert result.exit_code == ExitCode.PASSED
    assert [(pair.writer, pair.reader) for pair in result.pairs] == [
        (cluster.urls[0], cluster.urls[1]),
        (cluster.urls[1], cluster.urls[2]),
        (cluster.urls[2], cluster.urls[0]),
    ]
    for pair in result.pairs:
        assert pair.verdict is Verdict.PASSED
        assert pair.answers_equal is True
        assert pair.cold is not None and pair.cold.text == CORRECT_ANSWER
        assert pair.external_hit_tokens == pair.expected_external_hit_tokens == 128
        assert pair.load_get_keys == 4
        assert pair.warm is not None and pair.warm.cached_tokens == 128
        assert pair.notes == []
    assert result.request_latency_s <= result.wall_s


async def test_each_pair_sends_two_chats_and_four_metrics_reads_with_one_fresh_salt() -> None:
    with FakeCluster.start(2) as cluster:
        result = await canary(cluster)
        for replica in cluster.replicas:
            assert len(replica.requests_to("/v1/chat/completions")) == 2  # writer once, reader once
            # read twice as the reader and twice as the writer (its saves explain a reader's miss)
            assert len(replica.requests_to("/metrics")) == 4
        reader_of_pair_0 = cluster[1].requests_to("/v1/chat/completions")
    salts = [pair.cache_salt for pair in result.pairs]
    assert len(set(salts)) == 2
    assert all(salt.startswith(f"canary-{result.run_id}-") for salt in salts)
    assert reader_of_pair_0[0].cache_salt == salts[0]  # the warm request carries the cold one's salt


@pytest.mark.parametrize(
    ("mode", "violation"),
    [
        (Mode.US_EAST, 'warm answer: the JSON object holds the excluded value "us-east"'),
        (Mode.OLD_BATCH_SIZE, "warm answer: the JSON object holds the excluded value 8"),
        (Mode.OMIT_FIELD, "warm answer: the JSON object holds no value 16"),
        (Mode.PARAPHRASE, f"warm answer: text before the JSON object: {PARAPHRASE!r}"),
    ],
)
async def test_each_customer_corruption_fails_with_position_texts_and_violations(
    mode: Mode, violation: str
) -> None:
    with FakeCluster.start(2, modes=[Mode.CORRECT, mode]) as cluster:
        result = await canary(cluster, pairs="first")
    assert result.verdict is Verdict.FAILED
    assert result.exit_code == ExitCode.FAILED
    [pair] = result.pairs
    assert pair.answers_equal is False
    assert pair.mismatch is not None
    assert pair.warm is not None and pair.cold is not None
    assert pair.cold.text == CORRECT_ANSWER and pair.warm.text != CORRECT_ANSWER
    assert pair.cold.text[: pair.mismatch.position] == pair.warm.text[: pair.mismatch.position]
    # The distributions say corruption, with the first differing token and its margins.
    assert pair.divergence is not None and pair.divergence.kind == "corruption"
    assert pair.reasons[0].startswith(
        "warm answer diverges from the cold one: corruption divergence at token"
    )
    assert "not in the cold answer's top-5" in pair.reasons[0]
    assert violation in pair.expectation_violations
    assert not any(problem.startswith("cold") for problem in pair.expectation_violations)
    assert pair.external_hit_tokens == 128  # it did load: the corruption is real, not a cold recompute


async def test_double_prune_signature_is_reported_as_evidence() -> None:
    with FakeCluster.start(2, modes=[Mode.CORRECT, Mode.DOUBLE_PRUNE]) as cluster:
        result = await canary(cluster, pairs="first")
    [pair] = result.pairs
    assert pair.verdict is Verdict.FAILED
    assert pair.load_get_keys == 3
    assert any(
        "connector loaded 3 blocks (96 tokens) but the scheduler counted 128 tokens" in n for n in pair.notes
    )


async def test_double_prune_keys_alone_do_not_decide_the_verdict() -> None:
    evidence = _evidence(load_get=3)
    pair = judge_pair(evidence, CanaryConfig(replicas=["http://a:1", "http://b:1"], **EAGLE_32))
    assert pair.verdict is Verdict.PASSED
    assert any("double-prune signature" in note for note in pair.notes)


@pytest.mark.parametrize(
    ("put", "failed", "reason"),
    [
        (5, 5, "the writer's store rejected 5 of the 5 keys it tried to save"),
        (0, 0, "the writer reported no store put for this pair"),
    ],
)
def test_a_reader_that_found_nothing_is_explained_by_the_writers_saves(
    put: int, failed: int, reason: str
) -> None:
    writer_before = StoreCounters(store_keys_by_operation={"save_put": 10})
    writer_after = StoreCounters(
        store_keys_by_operation={"save_put": 10 + put},
        store_failed_keys_by_operation={"save_put": failed},
    )
    healthy = _evidence(warm_cached=0)
    assert healthy.after is not None
    evidence = replace(
        healthy,
        after=healthy.after.model_copy(update={"external_hit_tokens": 0, "store_keys_by_operation": {}}),
        writer_before=writer_before,
        writer_after=writer_after,
        put_wait=None,
    )
    pair = judge_pair(evidence, CanaryConfig(replicas=["http://a:1", "http://b:1"], **EAGLE_32))
    assert pair.verdict is Verdict.INCONCLUSIVE
    assert "the warm answer reports 0 cached prompt tokens" in pair.reasons[0]
    assert reason in pair.reasons[1]
    assert pair.writer_counters_delta is not None
    assert pair.writer_counters_delta.store_failed_keys_by_operation.get("save_put", 0) == failed


def test_the_writers_saves_never_turn_a_proven_pair_into_another_verdict() -> None:
    failing_writer = replace(
        _evidence(),
        writer_before=StoreCounters(),
        writer_after=StoreCounters(
            store_keys_by_operation={"save_put": 5}, store_failed_keys_by_operation={"save_put": 5}
        ),
    )
    pair = judge_pair(failing_writer, CanaryConfig(replicas=["http://a:1", "http://b:1"], **EAGLE_32))
    assert pair.verdict is Verdict.PASSED
    assert pair.reasons == []


async def test_a_warm_path_that_never_loads_is_inconclusive_never_passed() -> None:
    with FakeCluster.start(2, modes=[Mode.CORRECT, Mode.NEVER_LOADS]) as cluster:
        result = await canary(cluster)
    assert result.verdict is Verdict.INCONCLUSIVE
    assert result.exit_code == ExitCode.INCONCLUSIVE
    assert result.pairs[0].verdict is Verdict.INCONCLUSIVE
    assert result.pairs[0].answers_equal is True
    assert "the warm answer reports 0 cached prompt tokens" in result.pairs[0].reasons[0]
    assert "computed, not loaded from the store" in result.pairs[0].reasons[0]
    assert result.pairs[0].only_load_unproven is True
    assert result.pairs[1].verdict is Verdict.PASSED


async def test_http_500_on_the_warm_request_fails_and_is_not_retried() -> None:
    with FakeCluster.start(2, modes=[Mode.CORRECT, Mode.CORRECT]) as cluster:
        cluster[1].mode = Mode.HTTP_500
        config = CanaryConfig(replicas=cluster.urls, pairs="first", connect_retries=5, retry_backoff_s=0.01)
        result = await run_canary(config)
        assert len(cluster[1].requests_to("/v1/chat/completions")) == 1
    [pair] = result.pairs
    assert pair.verdict is Verdict.FAILED
    assert pair.warm is not None and pair.warm.status == 500
    assert pair.reasons == [
        f"warm request: POST {cluster.urls[1]}/v1/chat/completions returned HTTP 500: "
        "EngineCore encountered an issue."
    ]
    assert pair.warm.body_excerpt is not None and "EngineCore" in pair.warm.body_excerpt


def _warm_server_error(status: int, failed_before: int, failed_after: int) -> PairMeasurement:
    failed = ChatAnswer(
        url="http://b:1/v1/chat/completions",
        status=status,
        error_kind=ErrorKind.HTTP_STATUS,
        error=f"POST http://b:1/v1/chat/completions returned HTTP {status}: Internal server error",
    )
    return replace(
        _evidence(),
        warm=failed,
        before=StoreCounters(store_failed_keys_by_operation={"load_get": failed_before}),
        after=StoreCounters(store_failed_keys_by_operation={"load_get": failed_after}),
    )


def test_a_warm_500_over_failed_store_loads_says_the_store_failed_the_load() -> None:
    config = CanaryConfig(replicas=["http://a:1", "http://b:1"])
    pair = judge_pair(_warm_server_error(500, failed_before=6, failed_after=7), config)
    assert pair.verdict is Verdict.FAILED
    [reason] = pair.reasons
    assert reason.startswith("warm request: POST http://b:1/v1/chat/completions returned HTTP 500")
    assert "the reader failed to load 1 store keys during it" in reason
    assert "docs/troubleshooting.md" in reason


@pytest.mark.parametrize(
    ("status", "failed_before", "failed_after"),
    [
        (500, 6, 6),  # older failures: not this request's
        (404, 0, 3),  # not a server error: the load did not cause it
        (500, 9, 3),  # counters went backwards (a restart): no evidence either way
    ],
)
def test_a_warm_error_without_fresh_failed_loads_is_left_as_it_is(
    status: int, failed_before: int, failed_after: int
) -> None:
    config = CanaryConfig(replicas=["http://a:1", "http://b:1"])
    pair = judge_pair(_warm_server_error(status, failed_before, failed_after), config)
    assert pair.verdict is Verdict.FAILED
    assert not any("failed to load" in reason for reason in pair.reasons), pair.reasons


async def test_a_hanging_replica_times_out_and_fails() -> None:
    with FakeCluster.start(2, modes=[Mode.CORRECT, Mode.HANG]) as cluster:
        result = await canary(cluster, pairs="first", request_timeout_s=0.3)
        assert len(cluster[1].requests_to("/metrics")) == 1  # no second read of a hung reader
    [pair] = result.pairs
    assert pair.verdict is Verdict.FAILED
    assert pair.warm is not None and pair.warm.error_kind is ErrorKind.TIMEOUT
    assert pair.reasons == [
        f"warm request: POST {cluster.urls[1]}/v1/chat/completions: no complete answer within 0.3 s"
    ]
    assert pair.warm.latency_s < 2


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (Mode.NOT_VLLM, "returned HTTP 404: <html><body>404 Not Found</body></html> (is this a vLLM"),
        (Mode.NON_JSON, "answered 200 with a body that is not JSON (content-type 'text/plain')"),
        (Mode.NO_CHOICES, "answered 200 without 'choices': not a chat completion"),
    ],
)
async def test_a_writer_that_is_not_a_chat_server_fails_clearly_and_no_warm_is_sent(
    mode: Mode, message: str
) -> None:
    with FakeCluster.start(2, modes=[mode, Mode.CORRECT]) as cluster:
        result = await canary(cluster, pairs="first")
        assert cluster[1].requests_to("/v1/chat/completions") == []
    [pair] = result.pairs
    assert pair.verdict is Verdict.FAILED
    assert message in pair.reasons[0]
    assert pair.reasons[0].startswith(f"cold request: POST {cluster.urls[0]}/v1/chat/completions")
    assert pair.warm is None
    assert "warm request not sent" in pair.notes[0]


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (Mode.NO_METRICS, "/metrics returned HTTP 404"),
        (Mode.METRICS_WITHOUT_COUNTERS, "/metrics has no vllm:external_prefix_cache_hits_total"),
    ],
)
async def test_a_reader_without_the_counters_is_inconclusive(mode: Mode, message: str) -> None:
    with FakeCluster.start(2) as cluster:
        cluster[1].mode = mode
        result = await canary(cluster, pairs="first")
    [pair] = result.pairs
    assert pair.verdict is Verdict.INCONCLUSIVE
    assert pair.answers_equal is True
    assert pair.reasons[0].startswith("reader's counters unavailable: GET")
    assert message in pair.reasons[0]


async def test_an_unreachable_replica_is_retried_then_reported_as_a_connection_error() -> None:
    with FakeCluster.start(1) as cluster:
        config = CanaryConfig(
            replicas=[cluster.urls[0], closed_port_url()],
            pairs="first",
            connect_retries=2,
            retry_backoff_s=0.01,
        )
        result = await run_canary(config)
    [pair] = result.pairs
    assert pair.verdict is Verdict.INCONCLUSIVE
    assert result.exit_code == ExitCode.USAGE_OR_ENVIRONMENT
    assert pair.metrics_error is not None and "(3 attempts)" in pair.metrics_error
    assert pair.warm is not None and pair.warm.error_kind is ErrorKind.CONNECTION
    assert pair.warm.attempts == 3
    assert pair.connection_error is not None and pair.connection_error.startswith(
        "warm request: cannot connect"
    )


async def test_a_wrong_answer_outranks_an_unreachable_replica() -> None:
    with FakeCluster.start(2, modes=[Mode.CORRECT, Mode.US_EAST]) as cluster:
        urls = [*cluster.urls, closed_port_url()]
        result = await run_canary(CanaryConfig(replicas=urls, connect_retries=0))
    assert [pair.verdict for pair in result.pairs] == [
        Verdict.FAILED,
        Verdict.INCONCLUSIVE,
        Verdict.INCONCLUSIVE,
    ]
    assert result.exit_code == ExitCode.FAILED


async def test_a_smaller_hit_than_expected_is_inconclusive_a_larger_one_a_note() -> None:
    with FakeCluster.start(2) as cluster:
        short = await canary(
            cluster, pairs="first", block_size=None, eagle=False, expected_external_hit_tokens=160
        )
        long = await canary(
            cluster, pairs="first", block_size=None, eagle=False, expected_external_hit_tokens=96
        )
    assert short.verdict is Verdict.INCONCLUSIVE
    assert short.pairs[0].reasons == [
        "the warm answer reports 128 cached prompt tokens, expected 160: "
        "the warm path did not cover the whole stored prefix"
    ]
    assert long.verdict is Verdict.PASSED
    assert long.pairs[0].notes == [
        "the warm answer reports 128 cached prompt tokens, more than the 96 expected"
    ]


async def test_without_block_size_any_rise_counts() -> None:
    with FakeCluster.start(2) as cluster:
        result = await canary(cluster, block_size=None, eagle=False)
    assert result.verdict is Verdict.PASSED
    assert all(pair.expected_external_hit_tokens is None for pair in result.pairs)


async def test_an_engine_that_ignores_cache_salt_is_caught() -> None:
    with FakeCluster.start(2, modes=[Mode.IGNORES_SALT, Mode.IGNORES_SALT]) as cluster:
        result = await canary(cluster)
    assert result.verdict is Verdict.INCONCLUSIVE
    second = result.pairs[1]
    assert any(
        "the cold answer reports 160 cached prompt tokens despite a fresh cache_salt: it was not "
        "computed cold" in reason
        for reason in second.reasons
    )
    assert second.only_load_unproven is False  # no reference: requireExternalHit false cannot pass it


async def test_modes_change_while_replicas_run() -> None:
    with FakeCluster.start(2) as cluster:
        assert (await canary(cluster)).verdict is Verdict.PASSED
        cluster[0].mode = Mode.OLD_BATCH_SIZE
        flipped = await canary(cluster)
    assert [pair.verdict for pair in flipped.pairs] == [Verdict.PASSED, Verdict.FAILED]


async def test_content_checks_off_still_demands_equal_answers_and_the_hit() -> None:
    request = {
        **reference_request(),
        "messages": [{"role": "user", "content": "Say something stable. " * 20}],
    }
    with FakeCluster.start(2) as cluster:
        checked = await canary(cluster, request=request)
        unchecked = await canary(cluster, request=request, expectations=[])
    assert checked.verdict is Verdict.FAILED  # the customer's expectations do not fit this answer
    assert unchecked.verdict is Verdict.PASSED
    assert unchecked.expectations == []
    assert unchecked.warnings[0].startswith("content checks off")


async def test_a_client_can_be_injected() -> None:
    """An httpx transport stands in for the replicas: the canary uses the client it is given."""
    hits = {"http://a:8000": 0, "http://b:8000": 0}
    salts: set[str] = set()
    labels = 'model_name="MiniMaxAI/MiniMax-M2.5",engine="0"'

    def replica(request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if request.url.path == "/metrics":
            return httpx.Response(
                200,
                text=f"vllm:external_prefix_cache_hits_total{{{labels}}} {hits[base]}\n"
                f"vllm:spec_decode_num_drafts_total{{{labels}}} {hits[base]}\n"
                f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {hits[base]}\n"
                f"vllm:prefix_cache_hits_total{{{labels}}} 0\n",
            )
        hits[base] += 128
        logprobs = answer_logprobs(CORRECT_ANSWER, 5)
        choice = {"message": {"content": CORRECT_ANSWER}, "finish_reason": "stop", "logprobs": logprobs}
        salt = json.loads(request.content)["cache_salt"]
        cached = 128 if salt in salts else 0  # the warm request repeats the cold one's salt
        salts.add(salt)
        usage = {
            "prompt_tokens": 185,
            "completion_tokens": len(logprobs["content"]),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        spec = {
            "num_spec_steps": 1,
            "num_draft_tokens": 3,
            "num_accepted_draft_tokens": 1,
            "num_spec_tokens": 3,
            "acceptance_histogram": [0, 1, 0, 0],
            "mean_acceptance_length": 2.0,
            "draft_acceptance_rate": 1 / 3,
        }
        return httpx.Response(
            200, json={"choices": [choice], "usage": usage, "metrics": {"speculative_decoding": spec}}
        )

    async with httpx.AsyncClient(transport=httpx.MockTransport(replica)) as client:
        result = await run_canary(CanaryConfig(replicas=list(hits), **EAGLE_32), client=client)
        assert not client.is_closed
    assert result.verdict is Verdict.PASSED, result.reason
    assert [pair.external_hit_tokens for pair in result.pairs] == [128, 128]


def test_warm_cached_tokens_unmask_a_rise_from_other_traffic() -> None:
    pair = judge_pair(_evidence(warm_cached=0), CanaryConfig(replicas=["http://a:1", "http://b:1"]))
    assert pair.verdict is Verdict.INCONCLUSIVE
    assert pair.reasons == [
        "the warm answer reports 0 cached prompt tokens (usage.prompt_tokens_details): it was computed, not "
        "loaded from the store (KV connector on both replicas, same model, block size and PYTHONHASHSEED?)"
    ]


def test_replicas_that_tokenize_differently_fail() -> None:
    pair = judge_pair(_evidence(warm_prompt_tokens=186), CanaryConfig(replicas=["http://a:1", "http://b:1"]))
    assert pair.verdict is Verdict.FAILED
    assert "the replicas counted different prompt tokens (cold 185, warm 186)" in pair.reasons[0]


def test_ring_and_first_pairs() -> None:
    assert plan_pairs(["a", "b"], "ring") == [("a", "b"), ("b", "a")]
    assert plan_pairs(["a", "b", "c"], "ring") == [("a", "b"), ("b", "c"), ("c", "a")]
    assert plan_pairs(["a", "b", "c"], "first") == [("a", "b")]


def test_backoff_is_bounded_and_grows() -> None:
    policy = RetryPolicy(retries=5, backoff_s=0.5, max_backoff_s=3)
    assert [policy.delay_s(attempt) for attempt in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"replicas": ["http://a:1"]}, "at least 2"),
        ({"replicas": ["http://a:1", "http://a:1/"]}, "repeated: http://a:1"),
        ({"replicas": ["http://a:1", "a:1"]}, "must look like http://HOST:PORT"),
        ({"request": {**reference_request(), "stream": True}}, "must not stream"),
        ({"request": {**reference_request(), "cache_salt": "x"}}, "must not set 'cache_salt'"),
        ({"request": {"model": "m"}}, "non-empty 'messages'"),
        ({"eagle": True}, "eagle needs block_size"),
        ({"block_size": 16, "expected_external_hit_tokens": 128}, "not both"),
        ({"request_timeout_s": 0}, "greater than 0"),
    ],
)
def test_config_refuses_bad_input(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        CanaryConfig(**{"replicas": ["http://a:1", "http://b:1"], **options})


def test_replica_urls_are_normalized() -> None:
    config = CanaryConfig(replicas=["http://a:8000/", "https://b:8000/v1"])
    assert config.replicas == ["http://a:8000", "https://b:8000"]


def test_the_canary_imports_nothing_of_kubernetes() -> None:
    """It must run against any replicas: httpx, pydantic and prometheus_client's text parser only, no
    kopf, kubernetes or YAML, and none of the operator's own metrics."""
    code = (
        "import sys, mooncake_operator.canary; "
        "roots = {m.split('.')[0] for m in sys.modules}; "
        "ours = {'mooncake_operator.runtime.metrics'} & set(sys.modules); "
        "print(sorted(roots & {'kopf', 'kubernetes', 'yaml'} | ours))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert loaded.stdout.strip() == "[]"
