"""Prometheus parsing, the counters the canary reads, and the hit a prompt should give."""

from __future__ import annotations

import httpx
import pytest
from tests.support.fake_vllm import FakeReplica, FakeStore, block_hashes

from mooncake_operator.canary.client import CounterScrapeError, parse_metrics_response
from mooncake_operator.canary.metrics import (
    EXTERNAL_HITS,
    MetricsFormatError,
    expected_external_hit_tokens,
    parse_samples,
    store_counters,
)
from mooncake_operator.canary.models import ErrorKind, StoreCounters

pytestmark = pytest.mark.unit

# Shaped like vLLM 0.32's /metrics: HELP/TYPE lines, _created samples, two engines, several statuses.
VLLM_METRICS = """\
# HELP vllm:external_prefix_cache_hits_total External prefix cache hits from KV connector.
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="MiniMaxAI/MiniMax-M2.5"} 128.0
vllm:external_prefix_cache_hits_total{engine="1",model_name="MiniMaxAI/MiniMax-M2.5"} 32.0
vllm:external_prefix_cache_hits_created{engine="0",model_name="MiniMaxAI/MiniMax-M2.5"} 1.79e+09
vllm:external_prefix_cache_queries_total{engine="0",model_name="MiniMaxAI/MiniMax-M2.5"} 185.0
vllm:prefix_cache_hits_total{engine="0",model_name="MiniMaxAI/MiniMax-M2.5"} 0.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 57.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 128.0
vllm:mooncake_store_operation_keys_total{engine="0",model_name="m",operation="load_get",status="ok"} 3.0
vllm:mooncake_store_operation_keys_total{engine="0",model_name="m",operation="load_get",status="error"} 1.0
vllm:mooncake_store_operation_keys_total{engine="0",model_name="m",operation="save_put",status="ok"} 5.0
vllm:mooncake_store_operation_failed_keys_total{model_name="m",operation="load_get",status="error"} 1
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 2.0 1700000000000
vllm:gpu_cache_usage_perc{model_name="m"} NaN
process_open_fds 12
"""


def test_counters_are_summed_over_label_sets() -> None:
    counters = store_counters(parse_samples(VLLM_METRICS))
    assert counters == StoreCounters(
        external_hit_tokens=160,
        external_query_tokens=185,
        local_hit_tokens=0,
        prompt_tokens_by_source={"external_kv_transfer": 128, "local_compute": 57},
        store_keys_by_operation={"load_get": 4, "save_put": 5},
        store_failed_keys_by_operation={"load_get": 1},
        store_metrics_declared=True,
    )


def test_missing_metrics_are_none_not_zero() -> None:
    counters = store_counters(parse_samples("process_open_fds 12\n"))
    assert counters.external_hit_tokens is None
    assert counters.store_keys_by_operation == {}


def test_labels_with_escapes_commas_and_braces() -> None:
    [sample] = parse_samples('m{a="x,\\"y\\"}",b="line\\nbreak", c="back\\\\slash",} 1e3\n')
    assert sample.labels == {"a": 'x,"y"}', "b": "line\nbreak", "c": "back\\slash"}
    assert sample.value == 1000.0


# The last two make prometheus_client's parser raise IndexError, not ValueError.
@pytest.mark.parametrize(
    "text",
    ["<html>Not Found</html>", 'm{a="unterminated} 1', "metric notanumber", "{1en=, =1a", ' {, =\t_+}-"}xa'],
)
def test_non_prometheus_text_is_refused_with_the_line(text: str) -> None:
    with pytest.raises(MetricsFormatError, match="line 1"):
        parse_samples(text)


def test_delta_subtracts_and_keeps_absence() -> None:
    before = StoreCounters(external_hit_tokens=100, store_keys_by_operation={"save_put": 5}, latency_s=0.2)
    after = StoreCounters(
        external_hit_tokens=228, store_keys_by_operation={"save_put": 5, "load_get": 4}, latency_s=0.3
    )
    delta = after.delta(before)
    assert delta.external_hit_tokens == 128
    assert delta.local_hit_tokens is None
    assert delta.store_keys_by_operation == {"load_get": 4, "save_put": 0}
    assert delta.latency_s == 0.0


@pytest.mark.parametrize(
    ("prompt_tokens", "block_size", "eagle", "hit"),
    [
        (168, 32, True, 128),  # the customer's request on the tiny tokenizer, measured (e2e tier)
        (185, 32, True, 128),  # the same request as first measured in the design notes
        (185, 32, False, 160),
        (192, 32, False, 160),  # a whole-block prompt: the last token must be computed
        (192, 32, True, 160),  # ... Eagle's drop already leaves it out
        (193, 32, True, 160),
        (193, 32, False, 192),
        (31, 32, False, 0),
        (32, 32, False, 0),
        (64, 32, True, 32),
        (33, 32, True, 0),
        (0, 16, True, 0),
        (185, 16, True, 160),  # the customer's --block-size 16
    ],
)
def test_expected_external_hit(prompt_tokens: int, block_size: int, eagle: bool, hit: int) -> None:
    assert expected_external_hit_tokens(prompt_tokens, block_size, eagle=eagle) == hit


def test_expected_hit_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="block_size"):
        expected_external_hit_tokens(185, 0, eagle=False)


@pytest.mark.parametrize("eagle", [True, False])
@pytest.mark.parametrize("block_size", [16, 32])
def test_formula_agrees_with_the_fake_replicas_stepwise_lookup(eagle: bool, block_size: int) -> None:
    """The fake walks the store block by block as vLLM's lookup does; the formula must agree."""
    for prompt_tokens in range(1, 5 * block_size + 2):
        store = FakeStore()
        tokens = [f"t{i}" for i in range(prompt_tokens)]
        store.put(block_hashes(tokens, block_size, "salt"))
        replica = FakeReplica(store, block_size=block_size, eagle=eagle)
        try:
            looked_up = replica._store_lookup(block_hashes(tokens, block_size, "salt"), prompt_tokens)
        finally:
            replica.stop()
        assert looked_up == expected_external_hit_tokens(prompt_tokens, block_size, eagle=eagle), (
            prompt_tokens
        )


def test_only_the_named_metrics_are_parsed() -> None:
    text = VLLM_METRICS + "some garbage line that is not a sample\n"
    samples = parse_samples(text, only={EXTERNAL_HITS})
    assert {sample.name for sample in samples} == {EXTERNAL_HITS}
    assert sum(sample.value for sample in samples) == 160


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (404, '{"detail":"Not Found"}', "/metrics returned HTTP 404: Not Found (no metrics endpoint"),
        (200, "<html>hello</html>", "has no vllm:* metrics: not a vLLM server's metrics page"),
        (200, "vllm:num_requests_running 0\n", f"has no {EXTERNAL_HITS}: the warm path cannot be proven"),
        (200, f"{EXTERNAL_HITS}{{engine=0}} 1\n", "is not Prometheus text: line 1 has malformed labels"),
    ],
)
def test_metrics_pages_that_cannot_prove_anything_say_why(status: int, body: str, message: str) -> None:
    url = "http://127.0.0.1:9/metrics"
    with pytest.raises(CounterScrapeError) as raised:
        parse_metrics_response(url, httpx.Response(status, text=body), latency_s=0.01)
    assert message in raised.value.message
    assert raised.value.kind is (ErrorKind.HTTP_STATUS if status != 200 else ErrorKind.MALFORMED)
    assert raised.value.latency_s == 0.01
