"""Was the warm answer loaded from the store, and the cold one computed cold? Pure functions, no I/O.

The answers' own evidence decides first: vLLM reports, per request, the prompt tokens served from a
cache (`usage.prompt_tokens_details.cached_tokens`, with `--enable-prompt-tokens-details`) and what the
drafter did (`metrics.speculative_decoding`, with `--per-request-spec-decode-metrics`). The replica's
Prometheus counters are replica-wide: they corroborate the answers (a rise smaller than an answer claims
is a contradiction), and where an answer carries no evidence of its own a rise proves something only when
it is attributable to the canary's request alone, i.e. the replica served nothing else meanwhile. Other
users' requests that loaded from the store must never prove the canary's warm path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mooncake_operator.canary.metrics import (
    EXTERNAL_HITS,
    PROMPT_TOKENS,
    REQUESTS_FINISHED,
    REQUESTS_RUNNING,
    SPEC_DECODE_DRAFT_TOKENS,
    SPEC_DECODE_DRAFTS,
)
from mooncake_operator.canary.models import ChatAnswer, PutWait, PutWaitOutcome, StoreCounters

# The vLLM flags that make each answer carry its own evidence (vLLM 0.32's spellings). The operator and
# the sandbox render them on every replica (build/engine_args.py reads them from here), the spec-decode
# one only with a draft model: vLLM refuses it without --speculative-config. Replicas started by hand
# need them for per-request proof; without them the counters decide, and only when attributable.
PER_REQUEST_FLAG = "--enable-prompt-tokens-details"
PER_REQUEST_SPEC_OPTION = "--per-request-spec-decode-metrics"
PER_REQUEST_SPEC_LEVEL = "summary"  # adds metrics.speculative_decoding; "detailed" only adds arrays
PER_REQUEST_SPEC_FLAG = f"{PER_REQUEST_SPEC_OPTION} {PER_REQUEST_SPEC_LEVEL}"


def fallen_counters(before: StoreCounters, after: StoreCounters) -> str:
    """Which counters are lower in the later reading ("" when none): counters only fall on a restart."""
    fallen = []
    for name in (
        "external_hit_tokens",
        "external_query_tokens",
        "local_hit_tokens",
        "requests_finished",
        "prompt_tokens",
    ):
        earlier, later = getattr(before, name), getattr(after, name)
        if earlier is not None and later is not None and later < earlier:
            fallen.append(f"{name} {earlier} -> {later}")
    for name in ("prompt_tokens_by_source", "store_keys_by_operation", "store_failed_keys_by_operation"):
        earlier_map, later_map = getattr(before, name), getattr(after, name)
        fallen += [
            f"{name}[{key}] {value} -> {later_map.get(key, 0)}"
            for key, value in earlier_map.items()
            if later_map.get(key, 0) < value
        ]
    return ", ".join(fallen)


def attribution_problem(delta: StoreCounters, after: StoreCounters, answer: ChatAnswer) -> str | None:
    """Why a counter rise over a window in which the canary sent `answer`'s request alone cannot be
    attributed to it (None: it can). It can when the replica finished exactly one request in the window
    (`vllm:request_success_total`), prefilled exactly that request's prompt (`vllm:prompt_tokens_total`),
    and runs none at its end (`vllm:num_requests_running`): a user request admitted in the window (its
    hits counted at admission) either finished (a second request) or still runs."""
    problems = []
    if delta.requests_finished is None:
        problems.append(f"the page has no {REQUESTS_FINISHED}")
    elif delta.requests_finished != 1:
        problems.append(f"it finished {delta.requests_finished} requests in the window, the canary sent 1")
    if delta.prompt_tokens is None:
        problems.append(f"the page has no {PROMPT_TOKENS}")
    elif answer.prompt_tokens is None:
        problems.append("the answer has no usage.prompt_tokens to compare its prefill with")
    elif delta.prompt_tokens != answer.prompt_tokens:
        problems.append(
            f"it prefilled {delta.prompt_tokens} prompt tokens in the window, the canary's request has "
            f"{answer.prompt_tokens}"
        )
    if after.requests_running is None:
        problems.append(f"the page has no {REQUESTS_RUNNING}")
    elif after.requests_running > 0:
        problems.append(f"{after.requests_running} requests were still running at its end")
    return "; ".join(problems) if problems else None


@dataclass(frozen=True)
class LoadProof:
    """Whether the warm answer was loaded from the store: why not (unproven), what else is worth saying
    (notes), and what proved it (`source`, None when nothing did)."""

    unproven: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    source: Literal["answer", "counters"] | None = None


def load_proof(
    warm: ChatAnswer,
    delta: StoreCounters,
    after: StoreCounters,
    expected: int | None,
    *,
    eagle: bool,
    block_size: int | None,
) -> LoadProof:
    """The reader's load, from the warm answer's cached tokens when it reports them (the counters must
    not contradict it), else from its counters' rise when attributable to the warm request; every failed
    `load_get` key in the window (a recompute under kv_load_failure_policy recompute still counts the
    hit) and, with Eagle, drafts not shown for the warm request leave it unproven."""
    unproven: list[str] = []
    notes = hit_notes(delta, expected, block_size)
    hit = delta.external_hit_tokens or 0
    local = delta.local_hit_tokens or 0
    source: Literal["answer", "counters"] | None = None
    cached = warm.cached_tokens
    if cached is not None:
        if cached == 0:
            unproven.append(
                "the warm answer reports 0 cached prompt tokens (usage.prompt_tokens_details): it was "
                "computed, not loaded from the store (KV connector on both replicas, same model, block "
                "size and PYTHONHASHSEED?)"
            )
        elif expected is not None and cached < expected:
            unproven.append(
                f"the warm answer reports {cached} cached prompt tokens, expected {expected}: the warm path "
                "did not cover the whole stored prefix"
            )
        elif hit + local < cached:
            unproven.append(
                f"the warm answer reports {cached} cached prompt tokens but the reader's prefix-cache "
                f"counters rose by only {hit + local} ({EXTERNAL_HITS} {hit}, local {local}): the answer "
                "and the counters contradict each other"
            )
        else:
            source = "answer"
            if expected is not None and cached > expected:
                notes.append(
                    f"the warm answer reports {cached} cached prompt tokens, more than the {expected} "
                    "expected"
                )
    elif hit <= 0:
        unproven.append(
            f"reader's {EXTERNAL_HITS} did not rise: the warm answer was computed, not loaded from the "
            "store (KV connector on both replicas, same model, block size and PYTHONHASHSEED?)"
        )
    elif (why := attribution_problem(delta, after, warm)) is not None:
        unproven.append(
            f"reader's {EXTERNAL_HITS} rose by {hit}, but the warm answer carries no evidence of its own "
            f"and the rise cannot be attributed to it ({why}): other traffic may have made it; start the "
            f"replicas with {PER_REQUEST_FLAG} for per-request evidence"
        )
    elif expected is not None and hit < expected:
        unproven.append(
            f"reader loaded {hit} tokens from the store, expected {expected}: "
            "the warm path did not cover the whole stored prefix"
        )
    else:
        source = "counters"
        if expected is not None and hit > expected:
            notes.append(f"external hits rose by {hit}, more than the {expected} expected")
    failed_loads = delta.store_failed_keys_by_operation.get("load_get") or 0
    if failed_loads:
        unproven.append(
            f"the reader failed to load {failed_loads} store keys (load_get) during the warm request: the "
            "hit is counted when the request is scheduled, so under kv_load_failure_policy recompute the "
            "answer was recomputed, not loaded"
        )
    if eagle:
        unproven.extend(draft_problems(warm, delta, after))
    return LoadProof(unproven, notes, source if not unproven else None)


SPEC_DECODE_SERIES = (
    ("spec_decode_drafts", SPEC_DECODE_DRAFTS),
    ("spec_decode_draft_tokens", SPEC_DECODE_DRAFT_TOKENS),
)


def draft_problems(warm: ChatAnswer, delta: StoreCounters, after: StoreCounters) -> list[str]:
    """With Eagle configured: why the drafter is not shown to have run for the warm request.

    From the answer's own `metrics.speculative_decoding` when it has them (the counters must rise at
    least as much); else from the counters, attributable to the warm request. Drafts and draft tokens must
    rise; accepted tokens need not (every draft can be rejected)."""
    spec = warm.spec_decoding
    if spec is not None:
        if spec.num_spec_steps <= 0 or spec.num_draft_tokens <= 0:
            return [
                f"the warm answer's metrics.speculative_decoding shows no drafts ({spec.num_spec_steps} "
                f"verify steps, {spec.num_draft_tokens} draft tokens): the Eagle path did not run for it"
            ]
        counted = delta.spec_decode_draft_tokens
        if counted is None or counted < spec.num_draft_tokens:
            return [
                f"the warm answer reports {spec.num_draft_tokens} draft tokens but the reader's "
                f"{SPEC_DECODE_DRAFT_TOKENS} rose by "
                f"{counted if counted is not None else 'nothing (absent)'}: "
                "the answer and the counters contradict each other"
            ]
        return []
    problems = spec_decode_problems(delta)
    if problems:
        return problems
    why = attribution_problem(delta, after, warm)
    if why is not None:
        return [
            "reader's speculative-decoding counters rose, but the warm answer carries no drafting evidence "
            f"of its own and the rise cannot be attributed to it ({why}); start the replicas with "
            f"{PER_REQUEST_SPEC_FLAG}"
        ]
    return []


def spec_decode_problems(delta: StoreCounters) -> list[str]:
    """Why the counters do not show the drafter ran: a series missing, or one that did not rise."""
    problems = []
    for attribute, name in SPEC_DECODE_SERIES:
        rise = getattr(delta, attribute)
        if rise is None:
            problems.append(
                f"reader's metrics have no {name}: Eagle is configured but the reader serves without "
                "speculative decoding (its --speculative-config?)"
            )
        elif rise <= 0:
            problems.append(
                f"reader's {name} did not rise over the warm request: the Eagle path did not run "
                "(speculative decoding off for this request?)"
            )
    return problems


def cold_problems(
    cold: ChatAnswer, writer_delta: StoreCounters | None, writer_after: StoreCounters | None, unavailable: str
) -> list[str]:
    """Why the cold answer is not shown to be computed cold (it must be, to be the reference): it reports
    cached prompt tokens despite its fresh salt, or, without that evidence, the writer's prefix-cache
    counters rose over its request (attributable: it hit; not attributable: it cannot be told), or there is
    no evidence at all. `unavailable`: why the writer's counters are missing, when they are."""
    cached = cold.cached_tokens
    if cached is not None:
        if cached > 0:
            return [
                f"the cold answer reports {cached} cached prompt tokens despite a fresh cache_salt: it was "
                "not computed cold, so it is no reference (a proxy that drops cache_salt, or an engine that "
                "ignores it?)"
            ]
        return []
    if writer_delta is None or writer_after is None or writer_delta.external_hit_tokens is None:
        return [
            f"whether the cold answer was computed cold cannot be shown: it carries no "
            f"usage.prompt_tokens_details ({PER_REQUEST_FLAG}) and the writer's counters {unavailable}"
        ]
    external, local = writer_delta.external_hit_tokens or 0, writer_delta.local_hit_tokens or 0
    if external + local == 0:
        return []
    why = attribution_problem(writer_delta, writer_after, cold)
    if why is None:
        return [
            f"the cold request hit {external + local} cached prompt tokens on the writer (external "
            f"{external}, local {local}) despite a fresh cache_salt: it was not computed cold, so it is no "
            "reference (a proxy that drops cache_salt, or an engine that ignores it?)"
        ]
    return [
        f"the writer's prefix-cache hits rose by {external + local} during the cold request while it served "
        f"other requests too ({why}): whether the cold answer was computed cold cannot be shown; start the "
        f"replicas with {PER_REQUEST_FLAG}"
    ]


def hit_notes(delta: StoreCounters, expected: int | None, block_size: int | None) -> list[str]:
    """Evidence worth showing that does not decide the verdict."""
    hit = delta.external_hit_tokens or 0
    notes = []
    if delta.local_hit_tokens:
        notes.append(f"reader's local prefix cache hits rose by {delta.local_hit_tokens} tokens")
    load_get = delta.store_keys_by_operation.get("load_get")
    if block_size is not None and load_get is not None and hit > 0 and load_get * block_size < hit:
        notes.append(
            f"connector loaded {load_get} blocks ({load_get * block_size} tokens) but the scheduler "
            f"counted {hit} tokens ({hit // block_size} blocks) as loaded: the double-prune signature "
            "of vLLM PR #43516 (key counts can also scale with tensor-parallel shards)"
        )
    return notes


def put_wait_notes(put_wait: PutWait | None, writer_delta: StoreCounters | None) -> list[str]:
    """Why the reader may have found nothing: what the writer's store puts did before the warm request
    (the wait's outcome; else the writer's counters over the pair)."""
    failed = attempted = None
    if put_wait is not None and put_wait.outcome is PutWaitOutcome.FAILED:
        failed = put_wait.failed_keys or 0
        attempted = failed + (put_wait.keys_reported or 0)
    elif put_wait is None and writer_delta is not None:
        failed = writer_delta.store_failed_keys_by_operation.get("save_put") or None
        attempted = writer_delta.store_keys_by_operation.get("save_put", 0)
    if failed:
        return [
            f"the writer's store rejected {failed} of the {attempted} keys it tried to save (save_put "
            "failures, vllm:mooncake_store_operation_failed_keys_total): the prefix did not fully "
            "reach the store; the writer's log says why"
        ]
    if put_wait is not None:
        outcome = put_wait.outcome
        if outcome is PutWaitOutcome.TIMEOUT:
            return [
                "the writer had not reported store puts covering the prompt when the warm request was "
                f"sent ({put_wait.describe()}): raise the put wait (--put-wait, "
                "spec.canary.putWaitSeconds) if its store is slow"
            ]
        if outcome is PutWaitOutcome.NO_STORE_METRICS:
            return [
                "the writer's metrics declare no Mooncake store counters: whether it saved the prefix is "
                "unknown"
            ]
        if outcome is PutWaitOutcome.OFF:
            return ["the warm request was sent without waiting for the writer's store puts (put wait 0)"]
        if outcome is PutWaitOutcome.UNAVAILABLE:
            return [
                "the writer's counters could not be read, so the warm request was sent without waiting "
                "for its store puts"
            ]
        if outcome is PutWaitOutcome.COVERED:
            return []
    if writer_delta is not None and writer_delta.store_keys_by_operation.get("save_put", 0) == 0:
        return [
            "the writer reported no store put for this pair by the time the reader was asked "
            "(still running, skipped, or its KV connector does not save)"
        ]
    return []


def keys_needed(prompt_tokens: int | None, block_size: int | None) -> int | None:
    """The save_put keys the writer must report before the warm request: one per full prompt block at
    least (each layout writes one key per block and kept shard; a sharded cache writes more), or None when
    the block size is unknown (then any put)."""
    if block_size is None or prompt_tokens is None:
        return None
    return prompt_tokens // block_size
