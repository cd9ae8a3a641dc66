"""The protocol: per ordered pair (writer, reader), a cold answer, a warm answer, and the reader's counters.

For each pair, in order and never overlapping (overlap would blur whose traffic moved a counter):
a fresh `cache_salt` (mixed into the first block's hash, so the writer is truly cold and the reader
can only hit what the writer just stored); read the reader's counters; send the request to the
writer; send the identical request to the reader; read the reader's counters again. The verdict is
a pure function of what was measured (`judge_pair`), so it is tested without any server.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime

import httpx

from mooncake_operator.canary.client import CounterScrapeError, RetryPolicy, chat, scrape_counters
from mooncake_operator.canary.divergence import judge_divergence, unjudged_divergence
from mooncake_operator.canary.expectations import violations
from mooncake_operator.canary.metrics import (
    EXTERNAL_HITS,
    SPEC_DECODE_DRAFT_TOKENS,
    SPEC_DECODE_DRAFTS,
    expected_external_hit_tokens,
)
from mooncake_operator.canary.models import (
    CanaryConfig,
    CanaryResult,
    ChatAnswer,
    Comparison,
    ComparisonMode,
    Divergence,
    DivergenceKind,
    ErrorKind,
    Mismatch,
    PairResult,
    RunCost,
    StoreCounters,
    SuiteEntry,
    Verdict,
    redact_url,
)
from mooncake_operator.canary.request import SuiteError, default_suite

_CONTEXT_BEFORE = 20
_CONTEXT_AFTER = 40


@dataclass(frozen=True)
class PairMeasurement:
    """Everything measured for one pair, before judging it."""

    index: int
    writer: str
    reader: str
    cache_salt: str
    cold: ChatAnswer | None
    warm: ChatAnswer | None
    before: StoreCounters | None
    after: StoreCounters | None
    metrics_error: CounterScrapeError | None
    wall_s: float
    # The writer's counters around the pair: never decide a pass, only explain a reader that found
    # nothing (e.g. the writer's store puts failed). None when they could not be read.
    writer_before: StoreCounters | None = None
    writer_after: StoreCounters | None = None
    # Which of the run's requests was sent (`CanaryConfig.requests()`); None: the config's own request.
    request: SuiteEntry | None = None


async def run_canary(config: CanaryConfig, *, client: httpx.AsyncClient | None = None) -> CanaryResult:
    """Run every pair of `config` and judge them. Creates and closes its own client when none is given."""
    if client is not None:
        return await _run(config, client)
    # trust_env=False: replica URLs are direct addresses; an environment proxy must not reroute them.
    async with httpx.AsyncClient(trust_env=False) as own_client:
        return await _run(config, own_client)


def plan_pairs(replicas: list[str], mode: str) -> list[tuple[str, str]]:
    """`ring`: each replica writes for the next one, so every replica is proven as writer and reader."""
    if mode == "first":
        return [(replicas[0], replicas[1])]
    return [(writer, replicas[(index + 1) % len(replicas)]) for index, writer in enumerate(replicas)]


def new_cache_salt(run_id: str, index: int) -> str:
    """Unique per pair and run; within vLLM's limits (<= 128 chars, no '@', '/', '\\')."""
    return f"canary-{run_id}-{index}-{uuid.uuid4().hex}"


def expected_hit_for(config: CanaryConfig, prompt_tokens: int | None) -> int | None:
    """The external hit this pair must show, or None when any rise above 0 will do."""
    if config.expected_external_hit_tokens is not None:
        return config.expected_external_hit_tokens
    if config.block_size is not None and prompt_tokens is not None:
        return expected_external_hit_tokens(prompt_tokens, config.block_size, eagle=config.eagle)
    return None


async def _run(config: CanaryConfig, client: httpx.AsyncClient) -> CanaryResult:
    run_id = uuid.uuid4().hex[:12]
    started_at = datetime.now(UTC)
    started = time.perf_counter()
    retry = RetryPolicy(retries=config.connect_retries, backoff_s=config.retry_backoff_s)
    requests, suite_problem = await run_requests(config, client)
    pairs = []
    index = 0
    for writer, reader in plan_pairs(config.replicas, config.pairs):
        for entry in requests:
            salt = new_cache_salt(run_id, index)
            evidence = await measure_pair(
                client,
                config,
                index=index,
                writer=writer,
                reader=reader,
                salt=salt,
                retry=retry,
                request=entry,
            )
            # Judging scans two answers of up to the body cap: off the event loop, so the operator's
            # other work (health probes, other resources) goes on meanwhile.
            pairs.append(await asyncio.to_thread(judge_pair, evidence, config))
            index += 1
    verdict, reason = summarize(pairs)
    if suite_problem is not None and verdict is Verdict.PASSED:
        verdict, reason = Verdict.INCONCLUSIVE, suite_problem
    elif suite_problem is not None:
        reason = f"{reason}; {suite_problem}"
    return CanaryResult(
        run_id=run_id,
        verdict=verdict,
        reason=reason,
        replicas=[redact_url(url) for url in config.replicas],
        pairs_mode=config.pairs,
        pairs=pairs,
        expectations=[expectation.describe() for expectation in config.expectations],
        block_size=config.block_size,
        eagle=config.eagle,
        comparison=config.comparison,
        requests=[entry.name for entry in requests],
        cost=run_cost(pairs),
        warnings=config_warnings(config),
        started_at=started_at,
        wall_s=time.perf_counter() - started,
        request_latency_s=sum(pair.request_latency_s for pair in pairs),
    )


async def run_requests(
    config: CanaryConfig, client: httpx.AsyncClient
) -> tuple[list[SuiteEntry], str | None]:
    """The requests every pair runs: the config's request, then its suite; and why the default suite
    could not be built (None when it was, or none was asked for). Without it the run is at best
    Inconclusive: the block boundaries it would have covered are unproven."""
    primary = config.primary_request()
    if config.suite == "off":
        return [primary], None
    if isinstance(config.suite, list):
        return [primary, *config.suite], None
    assert config.block_size is not None  # CanaryConfig refuses the default suite without it
    try:
        built = await default_suite(
            client,
            config.replicas[0],
            config.request,
            block_size=config.block_size,
            expectations=config.expectations,
            request_timeout_s=config.request_timeout_s,
        )
    except SuiteError as error:
        return [primary], (
            f"the default block-boundary suite could not be built ({error}); only the request ran "
            "(supply your own suite, or turn it off: spec.canary.suite [] / --no-suite)"
        )
    # The suite's first request is the config's own (with its expectations): keep ours, add the rest.
    extra = [
        SuiteEntry(name=item.name, request=item.request, expectations=item.expectations)
        for item in built
        if item.request != config.request
    ]
    return [primary, *extra], None


def run_cost(pairs: list[PairResult]) -> RunCost:
    answers = [answer for pair in pairs for answer in (pair.cold, pair.warm) if answer is not None]
    reads = sum(
        (pair.counters_before is not None)
        + (pair.counters_after is not None)
        + (pair.metrics_error is not None)
        for pair in pairs
    )
    return RunCost(
        chat_requests=len(answers),
        metrics_reads=reads,
        prompt_tokens=sum(answer.prompt_tokens or 0 for answer in answers),
        completion_tokens=sum(answer.completion_tokens or 0 for answer in answers),
    )


async def measure_pair(
    client: httpx.AsyncClient,
    config: CanaryConfig,
    *,
    index: int,
    writer: str,
    reader: str,
    salt: str,
    retry: RetryPolicy | None = None,
    request: SuiteEntry | None = None,
) -> PairMeasurement:
    """One pair as the canary measures it: reader's counters, cold on the writer, warm on the reader,
    reader's counters again. Judge it with `judge_pair`. `request`: which request (default: the
    config's own)."""
    if retry is None:
        retry = RetryPolicy(retries=config.connect_retries, backoff_s=config.retry_backoff_s)
    entry = request or config.primary_request()
    model = entry.request.get("model") if isinstance(entry.request.get("model"), str) else None
    started = time.perf_counter()
    before, metrics_error = await _scrape(client, reader, config, retry, model)
    writer_before, _ = await _scrape(client, writer, config, retry, model)
    cold = await _chat(client, writer, config, retry, salt, entry)
    warm = after = writer_after = None
    if cold.ok:
        warm = await _chat(client, reader, config, retry, salt, entry)
        # An unresponsive reader would only make the second scrape wait out its timeout too.
        if before is not None and warm.error_kind not in (ErrorKind.CONNECTION, ErrorKind.TIMEOUT):
            after, metrics_error = await _scrape(client, reader, config, retry, model)
        if writer_before is not None:
            writer_after, _ = await _scrape(client, writer, config, retry, model)
    return PairMeasurement(
        index=index,
        writer=redact_url(writer),
        reader=redact_url(reader),
        cache_salt=salt,
        cold=cold,
        warm=warm,
        before=before,
        after=after,
        metrics_error=metrics_error,
        wall_s=time.perf_counter() - started,
        writer_before=writer_before,
        writer_after=writer_after,
        request=request,
    )


async def _chat(
    client: httpx.AsyncClient,
    url: str,
    config: CanaryConfig,
    retry: RetryPolicy,
    salt: str,
    entry: SuiteEntry,
) -> ChatAnswer:
    logprobs = config.comparison.mode is ComparisonMode.LOGPROBS
    return await chat(
        client,
        url,
        entry.request,
        cache_salt=salt,
        timeout=config.request_timeout_s,
        retry=retry,
        connect_timeout=config.connect_timeout_s,
        max_body_bytes=config.max_chat_body_bytes,
        top_logprobs=config.comparison.top_k if logprobs else None,
    )


async def _scrape(
    client: httpx.AsyncClient, reader: str, config: CanaryConfig, retry: RetryPolicy, model: str | None
) -> tuple[StoreCounters | None, CounterScrapeError | None]:
    try:
        counters = await scrape_counters(
            client,
            reader,
            timeout=config.metrics_timeout_s,
            retry=retry,
            connect_timeout=config.connect_timeout_s,
            max_body_bytes=config.max_metrics_body_bytes,
            model=model,
        )
    except CounterScrapeError as error:
        return None, error
    return counters, None


def judge_pair(evidence: PairMeasurement, config: CanaryConfig) -> PairResult:
    """Failed on any wrong or missing answer; Inconclusive when the warm path is not proven; else Passed."""
    cold, warm = evidence.cold, evidence.warm
    failures: list[str] = []
    unproven: list[str] = []
    notes: list[str] = []
    connection_error = None

    for role, answer in (("cold", cold), ("warm", warm)):
        if answer is None or answer.ok:
            continue
        message = f"{role} request: {answer.error}"
        if answer.error_kind is ErrorKind.CONNECTION:
            connection_error = connection_error or message
            unproven.append(message)
        elif answer.error_kind is ErrorKind.TOO_LARGE:
            unproven.append(message)  # not judged: it may be a right answer longer than the cap
        else:
            failures.append(message + _body_suffix(answer))
    if cold is not None and not cold.ok:
        notes.append("warm request not sent: the cold request gave no answer to compare with")

    entry = evidence.request or config.primary_request()
    mismatch = divergence = None
    answers_equal = None
    if cold is not None and warm is not None and cold.ok and warm.ok:
        comparison = compare_answers(cold, warm, config.comparison)
        mismatch, divergence = comparison.mismatch, comparison.divergence
        answers_equal = not comparison.failures and not comparison.unjudged and divergence is None
        failures.extend(comparison.failures)
        unproven.extend(comparison.unjudged)
        notes.extend(comparison.notes)
    failures.extend(model_problems(entry.request.get("model"), cold, warm))

    # On both answers, whatever the comparison said: a benign divergence never excuses wrong content.
    expectation_violations = [
        f"{role} answer: {problem}"
        for role, answer in (("cold", cold), ("warm", warm))
        if answer is not None and answer.ok and answer.text is not None
        for problem in violations(entry.expectations or [], answer.text)
    ]
    failures.extend(expectation_violations)

    prompt_tokens = cold.prompt_tokens if cold is not None else None
    expected = expected_hit_for(config, prompt_tokens)
    delta = evidence.after.delta(evidence.before) if evidence.after and evidence.before else None
    fallen = fallen_counters(evidence.before, evidence.after) if evidence.after and evidence.before else ""
    if warm is not None and delta is not None and not fallen:
        failures = [_with_store_load_failure(reason, warm, delta) for reason in failures]
    if warm is not None and warm.ok:
        if evidence.metrics_error is not None:
            if evidence.metrics_error.kind is ErrorKind.CONNECTION:
                connection_error = connection_error or evidence.metrics_error.message
            unproven.append(f"reader's counters unavailable: {evidence.metrics_error.message}")
        elif fallen:
            unproven.append(
                f"reader's counters went down between the reads ({fallen}): the replica restarted "
                "during the pair, so its rise is no evidence"
            )
        elif delta is not None:
            if config.block_size is not None and prompt_tokens is None:
                unproven.append(
                    "the cold answer has no usage.prompt_tokens: the exact hit demanded by the block size "
                    "cannot be computed (a vLLM OpenAI server always sends usage; a proxy dropped it?)"
                )
            unproven.extend(hit_problems(delta, expected, cold, warm))
            notes.extend(hit_notes(delta, expected, config.block_size))
            if config.eagle:
                unproven.extend(spec_decode_problems(delta))
    writer_delta = _writer_delta(evidence)
    if writer_delta is not None and unproven:
        unproven.extend(writer_save_notes(writer_delta))  # after the reader's reason: it explains it

    verdict = Verdict.FAILED if failures else Verdict.INCONCLUSIVE if unproven else Verdict.PASSED
    return PairResult(
        index=evidence.index,
        writer=evidence.writer,
        reader=evidence.reader,
        cache_salt=evidence.cache_salt,
        verdict=verdict,
        reasons=failures + unproven,
        notes=notes,
        cold=cold,
        warm=warm,
        counters_before=evidence.before,
        counters_after=evidence.after,
        counters_delta=delta,
        writer_counters_delta=writer_delta,
        metrics_error=evidence.metrics_error.message if evidence.metrics_error else None,
        prompt_tokens=prompt_tokens,
        external_hit_tokens=delta.external_hit_tokens if delta else None,
        expected_external_hit_tokens=expected,
        load_get_keys=delta.store_keys_by_operation.get("load_get") if delta else None,
        answers_equal=answers_equal,
        mismatch=mismatch,
        divergence=divergence,
        request_name=entry.name,
        expectation_violations=expectation_violations,
        connection_error=connection_error,
        wall_s=evidence.wall_s,
        request_latency_s=_request_latency(evidence),
    )


@dataclass(frozen=True)
class AnswerComparison:
    """What comparing a warm answer with the cold one found."""

    mismatch: Mismatch | None = None  # first differing character of the texts
    divergence: Divergence | None = None  # first differing token, judged (logprobs mode)
    failures: list[str] = field(default_factory=list)
    unjudged: list[str] = field(default_factory=list)  # differences without evidence: Inconclusive
    notes: list[str] = field(default_factory=list)


def compare_answers(
    cold: ChatAnswer, warm: ChatAnswer, comparison: Comparison | None = None
) -> AnswerComparison:
    """Exact: the texts (and reasoning) must be equal. Logprobs: identical tokens pass as in exact; at
    the first divergence the two distributions decide (`judge_divergence`): benign passes with a note,
    corruption fails, and differing answers without logprobs cannot be judged (Inconclusive)."""
    comparison = comparison or Comparison()
    failures: list[str] = []
    unjudged: list[str] = []
    notes: list[str] = []
    cold_text, warm_text = cold.text or "", warm.text or ""
    mismatch = None
    position = first_difference(cold_text, warm_text)
    if position is not None:
        mismatch = Mismatch(
            position=position, cold=_context(cold_text, position), warm=_context(warm_text, position)
        )
    text_problems = []
    if mismatch is not None:
        text_problems.append(
            f"warm answer differs from the cold one at character {mismatch.position}: "
            f"cold {mismatch.cold!r}, warm {mismatch.warm!r}"
        )
    if cold.reasoning != warm.reasoning:
        reasoning_position = first_difference(cold.reasoning or "", warm.reasoning or "")
        text_problems.append(f"warm reasoning differs from the cold one at character {reasoning_position}")
    divergence = None
    if comparison.mode is ComparisonMode.EXACT:
        failures.extend(text_problems)
    elif cold.logprobs is None or warm.logprobs is None:
        missing = " and ".join(
            role for role, answer in (("cold", cold), ("warm", warm)) if answer.logprobs is None
        )
        if text_problems:
            divergence = unjudged_divergence(comparison, missing=f"{missing} answer")
            unjudged.append(
                f"{text_problems[0]}; the {missing} answer sent no logprobs, so whether it is benign "
                "cannot be judged (a proxy that strips them? comparison mode exact demands equal text)"
            )
        else:
            notes.append(
                f"the {missing} answer sent no logprobs (the answers are equal, so none were needed)"
            )
    else:
        divergence = judge_divergence(cold.logprobs, warm.logprobs, comparison)
        if divergence is None:
            # Identical tokens: the texts must be identical too.
            failures.extend(f"{problem} although the tokens are identical" for problem in text_problems)
        elif divergence.kind is DivergenceKind.BENIGN:
            notes.append(f"passed over a {divergence.describe()}")
        else:
            failures.append(
                f"warm answer diverges from the cold one: {divergence.describe()}; not benign: "
                + "; ".join(divergence.reasons)
            )
    if cold.prompt_tokens != warm.prompt_tokens:
        failures.append(
            f"the replicas counted different prompt tokens (cold {cold.prompt_tokens}, warm "
            f"{warm.prompt_tokens}): they do not tokenize the request alike"
        )
    return AnswerComparison(mismatch, divergence, failures, unjudged, notes)


def model_problems(asked: object, cold: ChatAnswer | None, warm: ChatAnswer | None) -> list[str]:
    """An answer that names another model than the request asked for is not an answer to it."""
    if not isinstance(asked, str):
        return []
    return [
        f"{role} answer names model {answer.model!r}, the request asked for {asked!r}"
        for role, answer in (("cold", cold), ("warm", warm))
        if answer is not None and answer.ok and answer.model is not None and answer.model != asked
    ]


def fallen_counters(before: StoreCounters, after: StoreCounters) -> str:
    """Which counters are lower in the later reading ("" when none): counters only fall on a restart."""
    fallen = []
    for name in ("external_hit_tokens", "external_query_tokens", "local_hit_tokens"):
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


def hit_problems(
    delta: StoreCounters, expected: int | None, cold: ChatAnswer | None, warm: ChatAnswer
) -> list[str]:
    """Why the counters do not prove the warm answer was computed from the writer's stored prefix."""
    hit = delta.external_hit_tokens or 0
    problems = []
    if hit <= 0:
        problems.append(
            f"reader's {EXTERNAL_HITS} did not rise: the warm answer was computed, not loaded from the "
            "store (KV connector on both replicas, same model, block size and PYTHONHASHSEED?)"
        )
    elif expected is not None and hit < expected:
        problems.append(
            f"reader loaded {hit} tokens from the store, expected {expected}: "
            "the warm path did not cover the whole stored prefix"
        )
    cached = warm.cached_tokens
    if cached is not None and hit > 0 and cached == 0:
        problems.append(
            f"the warm answer reports 0 cached prompt tokens although the counter rose by {hit}: "
            "the rise came from other traffic"
        )
    elif cached is not None and expected is not None and cached < expected <= hit:
        problems.append(
            f"the warm answer reports {cached} cached prompt tokens, expected {expected}: "
            "other traffic made up the counter's rise"
        )
    if cold is not None and cold.cached_tokens:
        problems.append(
            f"the cold answer reports {cold.cached_tokens} cached prompt tokens despite a fresh "
            "cache_salt: it was not cold (does the engine honour cache_salt?)"
        )
    return problems


def hit_notes(delta: StoreCounters, expected: int | None, block_size: int | None) -> list[str]:
    """Evidence worth showing that does not decide the verdict."""
    hit = delta.external_hit_tokens or 0
    notes = []
    if expected is not None and hit > expected:
        notes.append(f"external hits rose by {hit}, more than the {expected} expected (other traffic)")
    if delta.local_hit_tokens:
        notes.append(f"reader's local prefix cache hits rose by {delta.local_hit_tokens} tokens")
    load_get = delta.store_keys_by_operation.get("load_get")
    if block_size is not None and load_get is not None and hit > 0 and load_get * block_size < hit:
        notes.append(
            f"connector loaded {load_get} blocks ({load_get * block_size} tokens) but the scheduler "
            f"counted {hit} tokens ({hit // block_size} blocks) as loaded: the double-prune signature "
            "of vLLM PR #43516 (key counts can also scale with tensor-parallel shards)"
        )
    failed_keys = delta.store_failed_keys_by_operation.get("load_get")
    if failed_keys:
        notes.append(f"{failed_keys} store keys failed to load on the reader")
    return notes


SPEC_DECODE_SERIES = (
    ("spec_decode_drafts", SPEC_DECODE_DRAFTS),
    ("spec_decode_draft_tokens", SPEC_DECODE_DRAFT_TOKENS),
)


def spec_decode_problems(delta: StoreCounters) -> list[str]:
    """With Eagle configured: why the counters do not prove the drafter ran over the warm request.

    Drafts and draft tokens must rise; accepted tokens may not (every draft can be rejected)."""
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


def _writer_delta(evidence: PairMeasurement) -> StoreCounters | None:
    before, after = evidence.writer_before, evidence.writer_after
    if before is None or after is None or fallen_counters(before, after):
        return None
    return after.delta(before)


def writer_save_notes(writer_delta: StoreCounters) -> list[str]:
    """Why the reader may have found nothing: what the writer's own store saves reported for the pair.

    vLLM's connector reports a save when its put returns, with the writer's next engine step; a put
    still running when the reader asked is not counted yet, hence "reported" below.
    """
    put = writer_delta.store_keys_by_operation.get("save_put", 0)
    failed = writer_delta.store_failed_keys_by_operation.get("save_put", 0)
    if failed:
        return [
            f"the writer's store rejected {failed} of the {put} keys it tried to save (save_put "
            "failures, vllm:mooncake_store_operation_failed_keys_total): the prefix did not fully "
            "reach the store; the writer's log says why"
        ]
    if put == 0:
        return [
            "the writer reported no store put for this pair by the time the reader was asked "
            "(still running, skipped, or its KV connector does not save)"
        ]
    return []


def summarize(pairs: list[PairResult]) -> tuple[Verdict, str]:
    """Overall verdict (worst pair wins) and a one-line reason."""
    for verdict in (Verdict.FAILED, Verdict.INCONCLUSIVE):
        bad = [pair for pair in pairs if pair.verdict is verdict]
        if bad:
            first = bad[0]
            return verdict, (
                f"{len(bad)} of {len(pairs)} pairs {verdict.value.lower()}; pair {first.index} "
                f"{first.writer} -> {first.reader}: {first.reasons[0]}"
            )
    hits = ", ".join(str(pair.external_hit_tokens) for pair in pairs)
    benign = [pair for pair in pairs if pair.divergence is not None]
    equal = "warm answer equals cold"
    if benign:
        first = benign[0]
        assert first.divergence is not None
        equal = (
            f"warm answer equals cold or parts from it at a benign near tie ({len(benign)} of them; pair "
            f"{first.index}: {first.divergence.describe()})"
        )
    return Verdict.PASSED, f"all {len(pairs)} pairs: {equal}, expectations hold, external hits {hits} tokens"


def config_warnings(config: CanaryConfig) -> list[str]:
    warnings = []
    if not config.expectations:
        warnings.append(
            "content checks off: no expectations; only cold/warm equality and the hit are checked"
        )
    temperature = config.request.get("temperature", 1.0)
    if temperature != 0 and "seed" not in config.request:
        warnings.append(
            f"the request samples (temperature {temperature}) without a seed: "
            "answers may differ without any cache fault"
        )
    return warnings


def first_difference(first: str, second: str) -> int | None:
    """Index of the first character where the texts differ (or the shorter one ends); None if equal."""
    if first == second:
        return None
    shorter = min(len(first), len(second))
    # Compare blocks in C first, then characters within the first block that differs: linear and fast.
    block = 4096
    start = 0
    while start < shorter and first[start : start + block] == second[start : start + block]:
        start += block
    for index in range(start, min(start + block, shorter)):
        if first[index] != second[index]:
            return index
    return shorter


def _context(text: str, position: int) -> str:
    start = max(0, position - _CONTEXT_BEFORE)
    return text[start : position + _CONTEXT_AFTER]


def _with_store_load_failure(reason: str, warm: ChatAnswer, delta: StoreCounters) -> str:
    """A warm server error explained by the reader's failed store loads, when they rose over it: vLLM
    fails a request whose KV load failed (kv_load_failure_policy "fail", its default) with a bare
    HTTP 500 and the reader logs only a warning, so this is the one place the cause is said."""
    failed_keys = delta.store_failed_keys_by_operation.get("load_get") or 0
    if not reason.startswith("warm request:") or not failed_keys or (warm.status or 0) < 500:
        return reason
    return (
        f"{reason} (the reader failed to load {failed_keys} store keys during it, "
        'vllm:mooncake_store_operation_failed_keys_total{operation="load_get"}: vLLM answers a request '
        "whose KV load failed with HTTP 500; the reader's log names the keys and Mooncake's error "
        "code, docs/troubleshooting.md)"
    )


def _body_suffix(answer: ChatAnswer) -> str:
    if answer.body_excerpt and answer.error_kind is ErrorKind.MALFORMED:
        return f"; body: {answer.body_excerpt[:200]!r}"
    return ""


def _request_latency(evidence: PairMeasurement) -> float:
    latencies = [answer.latency_s for answer in (evidence.cold, evidence.warm) if answer is not None]
    latencies += [
        counters.latency_s for counters in (evidence.before, evidence.after) if counters is not None
    ]
    if evidence.metrics_error is not None:
        latencies.append(evidence.metrics_error.latency_s)
    return sum(latencies)
