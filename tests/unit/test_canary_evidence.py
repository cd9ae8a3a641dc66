"""The warm path and the cold reference, judged from hand-made measurements (no servers): per-request
evidence first, counters as corroboration, and a counter rise as proof only when attributable."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from tests.support.canary_evidence import HIT, PROMPT_TOKENS, measurement, served

from mooncake_operator.canary.models import (
    CanaryConfig,
    PutWait,
    PutWaitOutcome,
    SpecDecoding,
    StoreCounters,
    Verdict,
)
from mooncake_operator.canary.runner import PairMeasurement, judge_pair

pytestmark = pytest.mark.unit

CONFIG = CanaryConfig(replicas=["http://a:1", "http://b:1"], block_size=32, eagle=True)


def counters_only(**after: Any) -> PairMeasurement:
    """A healthy pair whose answers carry no evidence of their own; `after` changes the reader's read."""
    healthy = measurement(warm_cached=None, cold_cached=None, spec=False)
    assert healthy.after is not None
    return replace(healthy, after=healthy.after.model_copy(update=after))


def test_the_full_evidence_passes_from_the_answer() -> None:
    pair = judge_pair(measurement(), CONFIG)
    assert pair.verdict is Verdict.PASSED, pair.reasons
    assert pair.hit_evidence == "answer" and pair.answers_equal is True


def test_a_quiet_reader_proves_the_load_by_its_counters() -> None:
    pair = judge_pair(counters_only(), CONFIG)
    assert pair.verdict is Verdict.PASSED, pair.reasons
    assert pair.hit_evidence == "counters"


@pytest.mark.parametrize(
    ("after", "why"),
    [
        ({"requests_finished": 2}, "it finished 2 requests in the window, the canary sent 1"),
        (
            {"prompt_tokens": PROMPT_TOKENS + 200},
            f"it prefilled {PROMPT_TOKENS + 200} prompt tokens in the window",
        ),
        ({"requests_running": 1}, "1 requests were still running at its end"),
        ({"requests_running": None}, "the page has no vllm:num_requests_running"),
        ({"prompt_tokens": None}, "the page has no vllm:prompt_tokens_total"),
    ],
)
def test_a_counter_rise_that_other_traffic_may_have_made_proves_nothing(
    after: dict[str, Any], why: str
) -> None:
    pair = judge_pair(counters_only(**after), CONFIG)
    assert pair.verdict is Verdict.INCONCLUSIVE and pair.only_load_unproven
    assert why in pair.reasons[0]
    assert "start the replicas with --enable-prompt-tokens-details" in pair.reasons[0]


def test_failed_store_loads_in_the_window_leave_the_load_unproven_on_either_evidence() -> None:
    for evidence in (measurement(), counters_only()):
        assert evidence.after is not None
        failing = replace(
            evidence,
            after=evidence.after.model_copy(update={"store_failed_keys_by_operation": {"load_get": 2}}),
        )
        pair = judge_pair(failing, CONFIG)
        assert pair.verdict is Verdict.INCONCLUSIVE
        assert any("the reader failed to load 2 store keys (load_get)" in reason for reason in pair.reasons)


def test_per_request_drafts_decide_and_the_counters_must_not_contradict_them() -> None:
    healthy = measurement()
    assert healthy.warm is not None and healthy.after is not None
    none = SpecDecoding(num_spec_steps=0, num_draft_tokens=0, num_accepted_draft_tokens=0, num_spec_tokens=3)
    pair = judge_pair(replace(healthy, warm=healthy.warm.model_copy(update={"spec_decoding": none})), CONFIG)
    assert pair.verdict is Verdict.INCONCLUSIVE
    assert "shows no drafts (0 verify steps, 0 draft tokens)" in pair.reasons[0]
    flat = healthy.after.model_copy(update={"spec_decode_draft_tokens": 0})
    pair = judge_pair(replace(healthy, after=flat), CONFIG)
    assert pair.verdict is Verdict.INCONCLUSIVE
    assert "the answer and the counters contradict each other" in pair.reasons[0]


def test_a_cold_answer_without_evidence_is_judged_by_the_writers_counters() -> None:
    healthy = counters_only()
    hit = served(1, PROMPT_TOKENS, external_hit_tokens=HIT, local_hit_tokens=0)
    loaded = judge_pair(replace(healthy, writer_after_cold=hit), CONFIG)
    assert loaded.verdict is Verdict.INCONCLUSIVE and not loaded.only_load_unproven
    assert "the cold request hit 128 cached prompt tokens on the writer" in loaded.reasons[0]
    busy = served(3, PROMPT_TOKENS + 400, external_hit_tokens=HIT, local_hit_tokens=0)
    unclear = judge_pair(replace(healthy, writer_after_cold=busy), CONFIG)
    assert "whether the cold answer was computed cold cannot be shown" in unclear.reasons[0]
    unread = judge_pair(
        replace(healthy, writer_before=None, writer_error="GET http://a:1/metrics: 404"), CONFIG
    )
    assert unread.verdict is Verdict.INCONCLUSIVE
    assert "the writer's counters could not be read (GET http://a:1/metrics: 404)" in unread.reasons[0]


def test_a_quiet_writers_flat_counters_prove_a_cold_answer_even_when_busy_elsewhere() -> None:
    """Other traffic only adds to a counter: no rise at all is proof whatever else the writer served."""
    busy_but_flat = served(5, 2000, external_hit_tokens=0, local_hit_tokens=0)
    pair = judge_pair(replace(counters_only(), writer_after_cold=busy_but_flat), CONFIG)
    assert pair.verdict is Verdict.PASSED, pair.reasons


def test_a_put_wait_that_timed_out_explains_a_miss_and_is_only_a_note_after_a_load() -> None:
    timeout = PutWait(outcome=PutWaitOutcome.TIMEOUT, waited_s=10.0, polls=12, keys_needed=5, keys_reported=2)
    healthy = measurement()
    passed = judge_pair(replace(healthy, put_wait=timeout), CONFIG)
    assert passed.verdict is Verdict.PASSED
    assert any(
        "were not all reported in time, yet the reader loaded the prefix" in note for note in passed.notes
    )
    missed = measurement(warm_cached=0)
    assert missed.after is not None
    flat = missed.after.model_copy(update={"external_hit_tokens": 0})
    pair = judge_pair(replace(missed, after=flat, put_wait=timeout), CONFIG)
    assert pair.verdict is Verdict.INCONCLUSIVE
    assert (
        "timeout after 10.000 s waiting for 5 keys (the prompt's full blocks), 2 reported" in pair.reasons[1]
    )


def test_counters_that_went_down_on_the_writer_are_no_cold_evidence() -> None:
    healthy = counters_only()
    restarted = StoreCounters(external_hit_tokens=0, requests_finished=0, prompt_tokens=0, requests_running=0)
    before = served(9, 9000, external_hit_tokens=500, local_hit_tokens=0)
    pair = judge_pair(replace(healthy, writer_before=before, writer_after_cold=restarted), CONFIG)
    assert pair.verdict is Verdict.INCONCLUSIVE
    assert "went down" in pair.reasons[0] and "the writer restarted" in pair.reasons[0]


def test_a_writer_whose_counters_cannot_be_read_explains_a_miss() -> None:
    missed = measurement(warm_cached=0)
    assert missed.after is not None
    unavailable = PutWait(outcome=PutWaitOutcome.UNAVAILABLE, waited_s=0.01, polls=1)
    pair = judge_pair(
        replace(
            missed, after=missed.after.model_copy(update={"external_hit_tokens": 0}), put_wait=unavailable
        ),
        CONFIG,
    )
    assert pair.verdict is Verdict.INCONCLUSIVE
    assert (
        "the writer's counters could not be read, so the warm request was sent without waiting"
        in (pair.reasons[1])
    )
