"""The canary against replicas that misbehave on purpose: huge or endless bodies, gzip bombs, blackholed
connects, weaker proof than asked for (missing usage, duplicate or non-finite or falling counters, another
model's answer). Every one ends in a clear Failed or Inconclusive reason, never a pass, a crash or
unbounded memory."""

from __future__ import annotations

import re
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from tests.support.fake_vllm import FakeCluster, FakeReplica
from tests.support.hostile_http import blackhole, endless, gzip_bomb, raw_server, response_head

from mooncake_operator.canary.client import CounterScrapeError, chat, scrape_counters
from mooncake_operator.canary.metrics import EXTERNAL_HITS
from mooncake_operator.canary.models import CanaryConfig, CanaryResult, ErrorKind, ExitCode, Verdict
from mooncake_operator.canary.request import reference_request
from mooncake_operator.canary.runner import run_canary

pytestmark = pytest.mark.unit

EAGLE_32: dict[str, Any] = {"block_size": 32, "eagle": True}
MIB = 1024 * 1024


async def canary(urls: list[str], **options: Any) -> CanaryResult:
    config = CanaryConfig(replicas=urls, **{"connect_retries": 0, **EAGLE_32, **options})
    return await run_canary(config)


# --- bodies --------------------------------------------------------------------------------------------


def _endless_chat(method: str, path: str) -> Iterator[bytes]:
    yield response_head(200, {"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    yield from endless()


def _gzip_bomb_everywhere(decoded: int) -> Callable[[str, str], Iterator[bytes]]:
    body = gzip_bomb(decoded)

    def respond(method: str, path: str) -> Iterator[bytes]:
        content_type = "text/plain" if path == "/metrics" else "application/json"
        headers = {"Content-Type": content_type, "Content-Encoding": "gzip", "Content-Length": str(len(body))}
        yield response_head(200, headers) + body

    return respond


async def test_an_endless_chat_body_stops_at_the_cap_and_is_inconclusive() -> None:
    with FakeCluster.start(1) as cluster, raw_server(_endless_chat) as endless_url:
        started = time.perf_counter()
        result = await canary([endless_url, cluster.urls[0]], max_chat_body_bytes=MIB, request_timeout_s=30)
    assert time.perf_counter() - started < 10  # the cap ends it, not the 30 s deadline
    cold = result.pairs[0].cold
    assert cold is not None and cold.error_kind is ErrorKind.TOO_LARGE
    assert result.verdict is Verdict.INCONCLUSIVE
    assert "larger than the 1048576-byte cap" in result.reason
    assert "max_chat_body_bytes" in result.reason or "--max-chat-bytes" in result.reason


async def test_a_gzip_bomb_counts_decoded_bytes_against_the_cap_with_bounded_memory() -> None:
    # 64 MiB decoded, ~64 KiB on the wire; the metrics cap is 1 MiB.
    with raw_server(_gzip_bomb_everywhere(64 * MIB)) as url:
        async with httpx.AsyncClient(trust_env=False) as client:
            tracemalloc.start()
            try:
                with pytest.raises(CounterScrapeError) as raised:
                    await scrape_counters(client, url, timeout=10, max_body_bytes=MIB)
                answer = await chat(
                    client, url, reference_request(), cache_salt="s", timeout=10, max_body_bytes=MIB
                )
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
    assert raised.value.kind is ErrorKind.TOO_LARGE
    assert "larger than the 1048576-byte cap" in raised.value.message
    assert answer.error_kind is ErrorKind.TOO_LARGE
    assert peak < 12 * MIB, f"peak {peak / MIB:.1f} MiB"


async def test_a_declared_content_length_over_the_cap_is_refused_unread() -> None:
    def huge(method: str, path: str) -> Iterator[bytes]:
        yield response_head(200, {"Content-Type": "application/json", "Content-Length": str(150 * MIB)})
        yield b"{" * 1024  # then nothing: a reader that waits for 150 MB would hit the deadline

    with raw_server(huge) as url:
        async with httpx.AsyncClient(trust_env=False) as client:
            answer = await chat(
                client, url, reference_request(), cache_salt=None, timeout=5, max_body_bytes=MIB
            )
    assert answer.error_kind is ErrorKind.TOO_LARGE
    assert answer.latency_s < 2


async def test_an_over_cap_metrics_page_makes_the_pair_inconclusive() -> None:
    with FakeCluster.start(2) as cluster:
        cluster[1].metrics_filter = lambda text: text + "# padding\n" * 200_000
        result = await canary(cluster.urls, pairs="first", max_metrics_body_bytes=MIB)
    assert result.verdict is Verdict.INCONCLUSIVE
    assert "reader's counters unavailable" in result.reason
    assert "cap" in result.reason


def test_the_caps_have_documented_defaults_and_can_be_raised() -> None:
    config = CanaryConfig(replicas=["http://a:1", "http://b:1"])
    assert config.max_chat_body_bytes == 4 * MIB
    assert config.max_metrics_body_bytes == 16 * MIB
    raised = CanaryConfig(replicas=["http://a:1", "http://b:1"], max_chat_body_bytes=64 * MIB)
    assert raised.max_chat_body_bytes == 64 * MIB


# --- timeouts ------------------------------------------------------------------------------------------


async def test_a_blackholed_replica_is_unreachable_retried_and_inconclusive() -> None:
    with FakeCluster.start(1) as cluster, blackhole() as hole:
        started = time.perf_counter()
        # Equal connect and request deadlines: the connect deadline must still be the one that fires.
        result = await canary(
            [hole, cluster.urls[0]],
            pairs="first",
            connect_timeout_s=0.5,
            request_timeout_s=0.5,
            metrics_timeout_s=0.5,
            connect_retries=2,
            retry_backoff_s=0.01,
        )
        elapsed = time.perf_counter() - started
    cold = result.pairs[0].cold
    assert cold is not None
    assert cold.error_kind is ErrorKind.CONNECTION, cold.error
    assert cold.attempts == 3
    assert "cannot connect" in (cold.error or "")
    assert result.verdict is Verdict.INCONCLUSIVE
    assert result.exit_code == ExitCode.USAGE_OR_ENVIRONMENT == 3
    assert elapsed < 6


# --- weaker proof --------------------------------------------------------------------------------------


def _without_usage(payload: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in payload.items() if key != "usage"}


async def test_missing_usage_is_inconclusive_when_the_exact_hit_is_demanded() -> None:
    with FakeCluster.start(2) as cluster:
        for replica in cluster.replicas:
            replica.payload_filter = _without_usage
        result = await canary(cluster.urls, pairs="first")
    assert result.verdict is Verdict.INCONCLUSIVE
    [pair] = result.pairs
    assert any("usage.prompt_tokens" in reason for reason in pair.reasons)
    # Without usage.completion_tokens the logprobs cannot be shown to cover the answer: never Passed.
    assert any("no usage.completion_tokens" in reason for reason in pair.reasons)


def _duplicate_line(name: str) -> Callable[[str], str]:
    def duplicate(text: str) -> str:
        lines = text.splitlines()
        found = [line for line in lines if line.startswith(name + "{")]
        return "\n".join(lines + found) + "\n"

    return duplicate


async def test_an_exact_duplicate_series_is_inconclusive_not_summed() -> None:
    with FakeCluster.start(2) as cluster:
        cluster[1].metrics_filter = _duplicate_line(EXTERNAL_HITS)
        # The doubled 96-token hit of a double-prune-free reader would read as 192 >= 128 expected.
        result = await canary(cluster.urls, pairs="first", expected_external_hit_tokens=None)
    assert result.verdict is Verdict.INCONCLUSIVE
    assert "duplicate" in result.reason


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
async def test_a_non_finite_counter_is_inconclusive(value: str) -> None:
    def poison(text: str) -> str:
        return re.sub(rf"^({re.escape(EXTERNAL_HITS)}\{{[^}}]*\}}) \S+$", rf"\1 {value}", text, flags=re.M)

    with FakeCluster.start(2) as cluster:
        cluster[1].metrics_filter = poison
        result = await canary(cluster.urls, pairs="first")
    assert result.verdict is Verdict.INCONCLUSIVE
    assert "not a finite" in result.reason


def _falls_between_reads(replica: FakeReplica) -> Callable[[str], str]:
    """The first read shows 1000 more hits than the second: the replica restarted in between."""
    reads = {"count": 0}

    def restart(text: str) -> str:
        reads["count"] += 1
        if reads["count"] % 2 == 0:
            return text

        def bump(match: re.Match[str]) -> str:
            return f"{match[1]} {float(match[2]) + 1000}"

        return re.sub(rf"^({re.escape(EXTERNAL_HITS)}\{{[^}}]*\}}) (\S+)$", bump, text, flags=re.M)

    return restart


async def test_a_counter_that_went_down_is_inconclusive_and_says_restart() -> None:
    with FakeCluster.start(2) as cluster:
        cluster[1].metrics_filter = _falls_between_reads(cluster[1])
        result = await canary(cluster.urls, pairs="first")
    assert result.verdict is Verdict.INCONCLUSIVE
    assert "went down" in result.reason
    assert "restart" in result.reason


async def test_an_answer_naming_another_model_fails_the_pair() -> None:
    with FakeCluster.start(2) as cluster:
        cluster[1].payload_filter = lambda payload: {**payload, "model": "some/other-model"}
        result = await canary(cluster.urls, pairs="first")
    assert result.verdict is Verdict.FAILED
    assert "some/other-model" in result.reason
    assert reference_request()["model"] in result.reason


async def test_an_answer_with_a_lone_surrogate_is_malformed_not_a_crash() -> None:
    def surrogate(payload: dict[str, Any]) -> dict[str, Any]:
        choice = {**payload["choices"][0], "message": {"role": "assistant", "content": "ok \ud800"}}
        return {**payload, "choices": [choice]}

    with FakeCluster.start(2) as cluster:
        cluster[1].payload_filter = surrogate
        result = await canary(cluster.urls, pairs="first")
    assert result.verdict is Verdict.FAILED
    assert "not valid Unicode" in result.reason
    result.model_dump_json()  # serializable
