"""The fault tier's revision-rollout arithmetic (tests/support/fault_rollout.py and the harness's answer
check in fault_scenarios.py): which answers users may get while a new revision rolls out, when nobody
served, which failures InPlace explains, and what BlueGreen promises about the client Service."""

from __future__ import annotations

import pytest
from tests.support.fault_load import OVERLOADED, Response
from tests.support.fault_rollout import (
    TrafficSample,
    bluegreen_violations,
    errors_outside,
    runs_model,
    unserved_seconds,
    unserved_windows,
)
from tests.support.fault_scenarios import ready_addresses, unexpected_answers

pytestmark = pytest.mark.unit

OLD, NEW = "demo-replica", "demo-r1a2b3c4"
OLD_PODS = {f"{OLD}-0": "10.0.0.1", f"{OLD}-1": "10.0.0.2"}
NEW_PODS = {f"{NEW}-0": "10.0.0.3", f"{NEW}-1": "10.0.0.4"}


def ok(started: float, answer: str) -> Response:
    return Response(started, 200, 0.1, answer)


def failed(started: float, status: int | str = "ConnectError") -> Response:
    return Response(started, status, 0.01, None)


def test_before_the_change_only_the_old_answer_after_recovery_only_the_new_one() -> None:
    responses = [ok(1, "a"), ok(11, "a"), ok(12, "b"), ok(21, "b"), failed(22)]
    assert unexpected_answers(responses, before="a", after="b", changed_at=10, settled_at=20) == []
    early_new, late_old = ok(5, "b"), ok(25, "a")
    wrong = unexpected_answers(
        [*responses, early_new, late_old], before="a", after="b", changed_at=10, settled_at=20
    )
    assert wrong == [early_new, late_old]


def test_a_third_answer_is_wrong_even_during_the_rollout() -> None:
    garbled = ok(15, "c")
    assert unexpected_answers([garbled], before="a", after="b", changed_at=10, settled_at=20) == [garbled]


def test_no_new_answer_measured_makes_every_answer_after_recovery_unexpected() -> None:
    late = ok(25, "b")
    assert unexpected_answers([ok(15, "a"), late], before="a", after=None, changed_at=10, settled_at=20) == [
        late
    ]


def test_a_scenario_that_changes_nothing_allows_only_the_reference() -> None:
    other = ok(15, "b")
    assert unexpected_answers([ok(5, "a"), other], before="a", after="a", changed_at=10, settled_at=20) == [
        other
    ]


def sample(
    at: float, endpoints: set[str], serving: str | None = OLD, candidate: str | None = None
) -> TrafficSample:
    return TrafficSample(at, {**OLD_PODS, **NEW_PODS}, frozenset(endpoints), serving, candidate)


def test_nobody_serving_is_widened_to_the_samples_around_it_plus_the_settle_time() -> None:
    samples = [sample(0, {"10.0.0.1"}), sample(2, set()), sample(4, set()), sample(6, {"10.0.0.3"})]
    assert unserved_windows(samples, 3.0) == [(0, 9.0)]
    assert unserved_seconds(samples) == 4.0


def test_nobody_serving_at_the_last_sample_stays_open() -> None:
    samples = [sample(0, {"10.0.0.1"}), sample(2, {"10.0.0.1"}), sample(4, set()), sample(5, set())]
    assert unserved_windows(samples, 3.0) == [(2, float("inf"))]
    assert unserved_seconds(samples) == 1.0
    assert unserved_windows(samples[:2], 3.0) == []


def test_in_place_explains_failures_only_while_nobody_served() -> None:
    windows = [(10.0, 20.0)]
    inside, before, after = failed(12), failed(5, 500), failed(21, "ReadTimeout")
    saturated = failed(3, OVERLOADED)
    assert errors_outside([ok(1, "a"), inside, before, after, saturated], windows) == [before, after]


def test_blue_green_keeps_the_old_set_at_full_size_until_the_switch() -> None:
    samples = [
        sample(0, set(OLD_PODS.values())),
        sample(2, set(OLD_PODS.values()), candidate=NEW),
        sample(4, {"10.0.0.3", "10.0.0.4", "10.0.0.1"}, serving=NEW),
        sample(6, set(NEW_PODS.values()), serving=NEW),
    ]
    assert bluegreen_violations(samples, OLD, 2) == []


def test_blue_green_violations_name_each_broken_promise() -> None:
    candidate_early = sample(2, {"10.0.0.1", "10.0.0.3"}, candidate=NEW)
    shrunk = sample(3, {"10.0.0.1"}, candidate=NEW)
    empty = sample(5, set(), serving=NEW)
    problems = bluegreen_violations([candidate_early, shrunk, empty], OLD, 2)
    assert len(problems) == 3
    assert "10.0.0.3" in problems[0] and "before the switch" in problems[1]
    assert "no ready address" in problems[2]
    assert bluegreen_violations([sample(0, set(OLD_PODS.values()))], OLD, 2) == [
        "no candidate set was ever seen in status.rollout"
    ]


def test_the_engine_container_serves_the_model_it_names() -> None:
    pod = {
        "spec": {
            "containers": [
                {"name": "vllm", "command": ["vllm", "serve"], "args": ["/models/revision-2/target", "--x"]},
                {"name": "sidecar", "args": ["/models/target"]},
            ]
        }
    }
    assert runs_model(pod, "/models/revision-2/target")
    assert not runs_model(pod, "/models/target")


def test_ready_addresses_follow_the_slices_as_kube_proxy_does() -> None:
    """Ready and unset `ready` count (kube-proxy routes to both); `ready: false` does not; every slice
    of the Service is read; an empty or missing list is nobody."""
    slices = {
        "items": [
            {
                "endpoints": [
                    {"addresses": ["10.244.0.7"], "conditions": {"ready": True}},
                    {"addresses": ["10.244.0.5"], "conditions": {"ready": False, "serving": True}},
                    {"addresses": ["10.244.0.9"]},
                ]
            },
            {"endpoints": [{"addresses": ["10.244.0.3"], "conditions": {}}]},
            {"endpoints": None},
        ]
    }
    assert ready_addresses(slices) == ["10.244.0.3", "10.244.0.7", "10.244.0.9"]
    assert ready_addresses({"items": []}) == []
    assert ready_addresses({}) == []
