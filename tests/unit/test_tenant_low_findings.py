"""Low findings of the multi-tenant review: secrets on the engine's command line, and an answer's keys
and values copied into the resource's status without bound."""

from __future__ import annotations

import pytest

from mooncake_operator.api.spec import EngineSpec
from mooncake_operator.canary.expectations import JsonFieldEquals
from mooncake_operator.reconcile.act.core import one_line

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--hf-token", "hf_abc"], "--hf-token"),
        (["--hf-token=hf_abc"], "--hf-token"),
        (["--hf_token=hf_abc"], "--hf-token"),
        (["--hf-tok", "hf_abc"], "--hf-token"),
        (["--api-key", "sk-1"], "--api-key"),
        (["--api-k=sk-1"], "--api-key"),
    ],
)
def test_a_secret_in_extra_args_is_refused_with_where_it_belongs(args: list[str], option: str) -> None:
    with pytest.raises(ValueError, match=f"must not contain {option}: a secret on the command line"):
        EngineSpec.model_validate({"image": "vllm:1", "extraArgs": args})


def test_options_that_only_share_a_prefix_stay_allowed() -> None:
    spec = EngineSpec.model_validate(
        {"image": "vllm:1", "extraArgs": ["--hf-overrides", "{}", "--api-server-count", "2"]}
    )
    assert spec.extra_args == ["--hf-overrides", "{}", "--api-server-count", "2"]


def test_an_answers_keys_and_values_reach_the_status_shortened() -> None:
    keys = {f"{'k' * 40}-{index}": index for index in range(1_000)}  # 47 KB, inside the search window
    answer = "{" + ", ".join(f'"{key}": {value}' for key, value in keys.items()) + "}"
    [missing] = JsonFieldEquals(field="replica", value=4).check(answer)
    assert len(missing) < 1_000 and missing.endswith("and 990 more)")
    huge_value = '{"replicas": "' + "x" * 60_000 + '"}'
    [wrong] = JsonFieldEquals(field="replica", value=4).check(huge_value)
    assert len(wrong) < 300


def test_a_replicas_words_cannot_start_a_log_line() -> None:
    forged = "model gone\n2026-12-02 04:00:00 INFO mooncake_operator: ns/x canary Passed\r\x1b[2K"
    assert one_line(forged) == (
        "model gone\\n2026-12-02 04:00:00 INFO mooncake_operator: ns/x canary Passed\\r\\x1b[2K"
    )
    assert one_line("pair 0 http://a:8000 -> http://b:8000: ok, ünïcode") == (
        "pair 0 http://a:8000 -> http://b:8000: ok, ünïcode"
    )
