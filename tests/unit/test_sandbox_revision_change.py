"""The revision-change verdict: a stale answer or foreign blocks fail, no sharing is inconclusive."""

from __future__ import annotations

import pytest

from mooncake_operator.canary.models import ChatAnswer, StoreCounters, Verdict
from mooncake_sandbox.revision_change import RevisionChangeReport, Served

pytestmark = pytest.mark.unit


def served(text: str, hit: int) -> Served:
    answer = ChatAnswer(url="http://127.0.0.1:1", status=200, text=text)
    return Served("replica-B@revision-2", answer, StoreCounters(external_hit_tokens=hit))


def report(*, shared_hit: int, stale: Served, cold: Served) -> RevisionChangeReport:
    return RevisionChangeReport(
        store_isolation=True,
        key_namespaces={},
        shared=served("revision 1", shared_hit),
        stale_candidate=stale,
        cold=cold,
        move_s=1.0,
    )


@pytest.mark.parametrize(
    ("shared_hit", "stale", "cold", "verdict", "says"),
    [
        (128, served("cold", 0), served("cold", 0), Verdict.PASSED, "loaded nothing"),
        (128, served("stale", 128), served("cold", 0), Verdict.FAILED, "a stale answer was served"),
        (128, served("stale", 0), served("cold", 0), Verdict.FAILED, "a stale answer was served"),
        (128, served("cold", 64), served("cold", 0), Verdict.FAILED, "never stored"),
        (0, served("stale", 128), served("cold", 0), Verdict.INCONCLUSIVE, "did not share"),
    ],
)
def test_verdicts(shared_hit: int, stale: Served, cold: Served, verdict: Verdict, says: str) -> None:
    result = report(shared_hit=shared_hit, stale=stale, cold=cold)
    assert result.verdict is verdict
    assert says in result.summary()
    assert result.as_json()["verdict"] == verdict.value
