"""Answers written to hurt the judge: a flood of `{`, a nest deeper than the interpreter's recursion limit, a
huge object. Judging one stays bounded in attempts and time and never stalls the caller's event loop (the
operator's loop also answers /healthz: a stall there restarts it, for every tenant)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tests.support.loop_lag import canary_with_loop_lag

from mooncake_operator.canary.expectations import (
    JSON_OBJECT_MAX_CHARS,
    JSON_SEARCH_ATTEMPTS,
    JsonObjectOnly,
    leaf_values,
    search_json,
)
from mooncake_operator.canary.models import Verdict
from mooncake_operator.canary.runner import first_difference

pytestmark = pytest.mark.unit


class _CountingDecoder(json.JSONDecoder):
    calls = 0
    longest = 0

    def raw_decode(self, s: str, idx: int = 0) -> tuple[Any, int]:
        type(self).calls += 1
        type(self).longest = max(type(self).longest, len(s) - idx)
        return super().raw_decode(s, idx)


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> type[_CountingDecoder]:
    _CountingDecoder.calls = _CountingDecoder.longest = 0
    monkeypatch.setattr(json, "JSONDecoder", _CountingDecoder)
    return _CountingDecoder


def test_a_brace_flood_is_tried_a_bounded_number_of_times(counting: type[_CountingDecoder]) -> None:
    search = search_json("{" * 20_000 + '{"a": 1}')
    assert search.found is None
    assert counting.calls == JSON_SEARCH_ATTEMPTS
    assert f"gave up after {JSON_SEARCH_ATTEMPTS} places" in search.missing()


def test_each_attempt_decodes_a_bounded_window(counting: type[_CountingDecoder]) -> None:
    huge = '{"a": [' + "1, " * JSON_OBJECT_MAX_CHARS + "1]}"
    search = search_json(huge)
    assert search.found is None
    assert counting.longest <= JSON_OBJECT_MAX_CHARS
    assert "the one at character 0 is longer than" in search.missing()
    [problem] = JsonObjectOnly().check(huge)
    assert problem.startswith(f"{search.missing()} in the answer")


def test_an_object_after_a_few_stray_braces_is_still_found() -> None:
    search = search_json("set {x} and {y}: " + '{"replicas": 4}')
    assert search.found is not None and search.found[0] == {"replicas": 4}


def test_a_nest_deeper_than_the_recursion_limit_is_no_object_not_a_crash() -> None:
    assert search_json('{"a": ' * 100_000).found is None
    deep: object = 1
    for _ in range(5_000):
        deep = [deep]
    assert list(leaf_values({"a": deep, "b": 2})) == [1, 2]


def test_first_difference_is_exact_around_block_edges() -> None:
    base = "x" * 10_000
    for position in (0, 1, 4095, 4096, 4097, 9_999):
        assert first_difference(base, base[:position] + "y" + base[position + 1 :]) == position
    assert first_difference(base, base[:5000]) == 5000
    assert first_difference(base, base) is None


@pytest.mark.parametrize(
    "content",
    [
        pytest.param("{" * 150_000, id="brace-flood"),  # about 8 s of one blocking scan before the fix
        pytest.param('{"a": ' * 50_000, id="deeper-than-recursion-limit"),  # raised out of the run before
        pytest.param('{"k": [' + "1, " * 300_000 + "1]}", id="huge-object"),
    ],
)
async def test_a_hostile_answer_fails_the_pair_without_stalling_the_event_loop(content: str) -> None:
    result, lag = await canary_with_loop_lag(content)
    assert result.verdict is Verdict.FAILED
    assert "no JSON object" in result.reason
    # A bound for correctness, not a speed target: the unbounded scan held the loop for seconds to hours.
    assert lag < 1.0, f"the event loop stalled {lag:.2f} s while judging"
