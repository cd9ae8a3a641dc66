"""The protocol: per ordered pair (writer, reader), a cold answer, a warm answer, and the evidence of both.

For each pair, in order and never overlapping (overlap would blur whose traffic moved a counter):
a fresh `cache_salt` (mixed into the first block's hash, so the writer is truly cold and the reader
can only hit what the writer just stored); read the writer's counters; send the request to the writer
(cold); wait, bounded, until the writer reports store puts covering the prompt's full blocks; read the
reader's counters; send the identical request to the reader (warm); read the reader's counters again;
when the answers part at an otherwise benign divergence, have the writer decode the tokens they share.
The verdict is a pure function of what was measured (`judge_pair`), so it is tested without any server.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx

from mooncake_operator.canary.client import CounterScrapeError, RetryPolicy, chat, detokenize, scrape_counters
from mooncake_operator.canary.compare import (
    AnswerComparison,
    compare_answers,
    first_difference,
    shared_tokens_to_decode,
)
from mooncake_operator.canary.evidence import (
    cold_problems,
    fallen_counters,
    keys_needed,
    load_proof,
    put_wait_notes,
)
from mooncake_operator.canary.expectations import Expectation, answer_text, value_agnostic, violations
from mooncake_operator.canary.metrics import expected_external_hit_tokens
from mooncake_operator.canary.models import (
    CanaryConfig,
    CanaryResult,
    ChatAnswer,
    ErrorKind,
    PairResult,
    PutWait,
    PutWaitOutcome,
    RunCost,
    SharedText,
    StoreCounters,
    SuiteEntry,
    Verdict,
    redact_url,
)
from mooncake_operator.canary.request import SuiteError, default_suite

__all__ = [
    "AnswerComparison",
    "PairMeasurement",
    "compare_answers",
    "first_difference",
    "judge_pair",
    "measure_pair",
    "plan_pairs",
    "run_canary",
]

# Polling the writer's counters while waiting for its puts: fast at first (a GPU put takes milliseconds),
# then at most twice a second.
_PUT_POLL_FIRST_S = 0.05
_PUT_POLL_MAX_S = 0.5


@dataclass(frozen=True)
class PairMeasurement:
    """Everything measured for one pair, before judging it."""

    index: int
    writer: str
    reader: str
    cache_salt: str
    cold: ChatAnswer | None
    warm: ChatAnswer | None
    # The reader's counters just before and after the warm request.
    before: StoreCounters | None
    after: StoreCounters | None
    metrics_error: CounterScrapeError | None
    wall_s: float
    # The writer's counters before the cold request and after its puts were waited for; None when they
    # could not be read (`writer_error` says why).
    writer_before: StoreCounters | None = None
    writer_after: StoreCounters | None = None
    # Which of the run's requests was sent (`CanaryConfig.requests()`); None: the config's own request.
    request: SuiteEntry | None = None
    # The writer's counters right after the cold answer (the cold proof's window); None: writer_after.
    writer_after_cold: StoreCounters | None = None
    writer_error: str | None = None
    put_wait: PutWait | None = None
    # The text of the tokens both answers share before an otherwise benign divergence.
    shared_text: SharedText | None = None
    # Checks a request without expectations of its own must pass when its answer is complete (the
    # default suite: the value-agnostic ones of the config's expectations).
    complete_answer_checks: tuple[Expectation, ...] = ()
    writer_metrics_reads: int = 0


@dataclass(frozen=True)
class PlannedRequest:
    entry: SuiteEntry
    complete_answer_checks: tuple[Expectation, ...] = ()


# Told a line at each step of a run (which pair, which request, time so far), for a person waiting on it.
Progress = Callable[[str], None]


def _no_progress(_: str) -> None:
    return None


async def run_canary(
    config: CanaryConfig, *, client: httpx.AsyncClient | None = None, progress: Progress | None = None
) -> CanaryResult:
    """Run every pair of `config` and judge them. Creates and closes its own client when none is given.
    `progress` is told each step in a line (replica URLs without their credentials)."""
    tell = progress or _no_progress
    if client is not None:
        result = await _run(config, client, tell)
    else:
        # trust_env=False: replica URLs are direct addresses; an environment proxy must not reroute them.
        async with httpx.AsyncClient(trust_env=False) as own_client:
            result = await _run(config, own_client, tell)
    return without_secrets(result, config.replicas)


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


async def _run(config: CanaryConfig, client: httpx.AsyncClient, tell: Progress) -> CanaryResult:
    run_id = uuid.uuid4().hex[:12]
    started_at = datetime.now(UTC)
    started = time.perf_counter()
    retry = RetryPolicy(retries=config.connect_retries, backoff_s=config.retry_backoff_s)
    tell(f"run {run_id}: planning the requests")
    planned, suite_problem = await plan_requests(config, client)
    replica_pairs = plan_pairs(config.replicas, config.pairs)
    total = len(replica_pairs) * len(planned)
    tell(
        f"[{time.perf_counter() - started:6.1f} s] run {run_id}: {len(replica_pairs)} replica pair(s) x "
        f"{len(planned)} request(s) = {total} measurement(s)"
    )
    pairs = []
    index = 0
    for writer, reader in replica_pairs:
        for number, item in enumerate(planned, start=1):
            step = f"{index + 1}/{total}"
            tell(
                f"[{time.perf_counter() - started:6.1f} s] {step}: {redact_url(writer)} writes, "
                f"{redact_url(reader)} reads; request {item.entry.name!r} ({number}/{len(planned)})"
            )
            salt = new_cache_salt(run_id, index)
            evidence = await measure_pair(
                client,
                config,
                index=index,
                writer=writer,
                reader=reader,
                salt=salt,
                retry=retry,
                request=item.entry,
                complete_answer_checks=item.complete_answer_checks,
            )
            # Judging scans two answers of up to the body cap: off the event loop, so the operator's
            # other work (health probes, other resources) goes on meanwhile.
            pairs.append(await asyncio.to_thread(judge_pair, evidence, config))
            tell(f"[{time.perf_counter() - started:6.1f} s] {step}: {pairs[-1].verdict.value}")
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
        requests=[item.entry.name for item in planned],
        cost=run_cost(pairs),
        warnings=config_warnings(config),
        started_at=started_at,
        wall_s=time.perf_counter() - started,
        request_latency_s=sum(pair.request_latency_s for pair in pairs),
    )


async def run_requests(
    config: CanaryConfig, client: httpx.AsyncClient
) -> tuple[list[SuiteEntry], str | None]:
    """The requests every pair runs (see `plan_requests`), without their answer checks."""
    planned, problem = await plan_requests(config, client)
    return [item.entry for item in planned], problem


async def plan_requests(
    config: CanaryConfig, client: httpx.AsyncClient
) -> tuple[list[PlannedRequest], str | None]:
    """The requests every pair runs: the config's request, then its suite; and why the default suite
    could not be built (None when it was, or none was asked for). Without it the run is at best
    Inconclusive: the block boundaries it would have covered are unproven. The default suite's padded
    requests carry no expectations of their own: they are judged on their tokens, and by the config's
    value-agnostic checks where their answer is complete (its budget is short: a reasoning model's ends
    inside the reasoning, and is judged on tokens alone)."""
    primary = PlannedRequest(config.primary_request())
    if config.suite == "off":
        return [primary], None
    if isinstance(config.suite, list):
        return [primary, *(PlannedRequest(entry) for entry in config.suite)], None
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
    checks = tuple(value_agnostic(config.expectations))
    # The suite's first request is the config's own (with its expectations): keep ours, add the rest.
    extra = [
        PlannedRequest(
            SuiteEntry(name=item.name, request=item.request, expectations=item.expectations),
            complete_answer_checks=checks if item.expectations is None else (),
        )
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
        writer_metrics_reads=sum(pair.writer_metrics_reads for pair in pairs),
        detokenize_requests=sum(pair.shared_text is not None for pair in pairs),
        put_wait_s=sum(pair.put_wait.waited_s for pair in pairs if pair.put_wait is not None),
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
    complete_answer_checks: tuple[Expectation, ...] = (),
) -> PairMeasurement:
    """One pair as the canary measures it (the module's docstring). Judge it with `judge_pair`.
    `request`: which request (default: the config's own)."""
    if retry is None:
        retry = RetryPolicy(retries=config.connect_retries, backoff_s=config.retry_backoff_s)
    entry = request or config.primary_request()
    model = entry.request.get("model") if isinstance(entry.request.get("model"), str) else None
    started = time.perf_counter()
    writer_before, writer_scrape_error = await _scrape(client, writer, config, retry, model)
    writer_error = writer_scrape_error.message if writer_scrape_error is not None else None
    writer_reads = 1
    cold = await send_chat(client, writer, config, salt=salt, request=entry, retry=retry)
    warm = before = after = metrics_error = writer_after_cold = writer_after = put_wait = shared_text = None
    if cold.ok:
        wait = await wait_for_puts(
            client,
            writer,
            config,
            retry,
            model,
            writer_before,
            keys_needed(cold.prompt_tokens, config.block_size),
        )
        put_wait, writer_after_cold, writer_after = wait.put_wait, wait.first, wait.last
        writer_reads += wait.put_wait.polls
        writer_error = writer_error or wait.error
        before, metrics_error = await _scrape(client, reader, config, retry, model)
        warm = await send_chat(client, reader, config, salt=salt, request=entry, retry=retry)
        # An unresponsive reader would only make the second scrape wait out its timeout too.
        if before is not None and warm.error_kind not in (ErrorKind.CONNECTION, ErrorKind.TIMEOUT):
            after, metrics_error = await _scrape(client, reader, config, retry, model)
        if warm.ok:
            tokens = shared_tokens_to_decode(cold, warm, config.comparison)
            if tokens is not None:
                shared_text = await detokenize(
                    client,
                    writer,
                    tokens,
                    model=model,
                    timeout=config.request_timeout_s,
                    retry=retry,
                    connect_timeout=config.connect_timeout_s,
                )
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
        writer_after_cold=writer_after_cold,
        writer_error=writer_error,
        put_wait=put_wait,
        shared_text=shared_text,
        complete_answer_checks=complete_answer_checks,
        writer_metrics_reads=writer_reads,
    )


async def send_chat(
    client: httpx.AsyncClient,
    url: str,
    config: CanaryConfig,
    *,
    salt: str,
    request: SuiteEntry | None = None,
    retry: RetryPolicy | None = None,
) -> ChatAnswer:
    """One chat request as the canary sends it: the entry's body (default: the config's request), the
    salt, logprobs by token id with `comparison.top_k` alternatives (both modes), the config's limits."""
    entry = request or config.primary_request()
    return await chat(
        client,
        url,
        entry.request,
        cache_salt=salt,
        timeout=config.request_timeout_s,
        retry=retry or RetryPolicy(retries=config.connect_retries, backoff_s=config.retry_backoff_s),
        connect_timeout=config.connect_timeout_s,
        max_body_bytes=config.max_chat_body_bytes,
        top_logprobs=config.comparison.top_k,
    )


@dataclass(frozen=True)
class PutWaitResult:
    put_wait: PutWait
    first: StoreCounters | None = None  # the first read after the cold answer
    last: StoreCounters | None = None  # the last one
    error: str | None = None


async def wait_for_puts(
    client: httpx.AsyncClient,
    writer: str,
    config: CanaryConfig,
    retry: RetryPolicy,
    model: str | None,
    before: StoreCounters | None,
    needed: int | None,
) -> PutWaitResult:
    """Read the writer's counters until its `save_put` keys (ok) rose by `needed` (None: by one), a put
    failed, or `config.put_wait_s` passed. The connector stores blocks from a sending thread no request
    waits for, so the warm request, sent at once, could miss what the writer is still storing. Reads at
    least once (the cold proof's window); waits not at all when the writer's counters cannot be read or
    declare no Mooncake store (nothing to wait on: the reader's evidence decides)."""
    started = time.perf_counter()
    first = last = None
    polls = 0
    interval = _PUT_POLL_FIRST_S

    def done(outcome: PutWaitOutcome, error: str | None = None) -> PutWaitResult:
        rose = last.delta(before) if last is not None and before is not None else None
        return PutWaitResult(
            PutWait(
                outcome=outcome,
                waited_s=time.perf_counter() - started,
                polls=polls,
                keys_needed=needed,
                keys_reported=rose.save_put_ok_keys if rose is not None else None,
                failed_keys=rose.store_failed_keys_by_operation.get("save_put") if rose is not None else None,
            ),
            first,
            last,
            error,
        )

    while True:
        counters, error = await _scrape(client, writer, config, retry, model)
        polls += 1
        if counters is None:
            assert error is not None
            return done(PutWaitOutcome.UNAVAILABLE, error.message)
        first = first or counters
        last = counters
        if before is None:
            return done(PutWaitOutcome.UNAVAILABLE, "could not be read before the cold request")
        if config.put_wait_s == 0:
            return done(PutWaitOutcome.OFF)
        if not counters.store_metrics_declared:
            return done(PutWaitOutcome.NO_STORE_METRICS)
        rose = counters.delta(before)
        if rose.store_failed_keys_by_operation.get("save_put"):
            return done(PutWaitOutcome.FAILED)
        if rose.save_put_ok_keys >= (needed if needed is not None else 1):
            return done(PutWaitOutcome.COVERED)
        remaining = config.put_wait_s - (time.perf_counter() - started)
        if remaining <= 0:
            return done(PutWaitOutcome.TIMEOUT)
        await asyncio.sleep(min(interval, remaining))
        interval = min(interval * 2, _PUT_POLL_MAX_S)


async def _scrape(
    client: httpx.AsyncClient, url: str, config: CanaryConfig, retry: RetryPolicy, model: str | None
) -> tuple[StoreCounters | None, CounterScrapeError | None]:
    try:
        counters = await scrape_counters(
            client,
            url,
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
    """Failed on any wrong or missing answer; Inconclusive when the warm path, the cold reference or the
    comparison is not proven; else Passed."""
    cold, warm = evidence.cold, evidence.warm
    failures: list[str] = []
    unproven: list[str] = []  # the comparison, the cold reference, content not judged, connections
    load_unproven: list[str] = []  # the reader's load alone
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
    comparison = None
    if cold is not None and warm is not None and cold.ok and warm.ok:
        comparison = compare_answers(cold, warm, config.comparison, evidence.shared_text)
        failures.extend(comparison.failures)
        unproven.extend(comparison.unjudged)
        notes.extend(comparison.notes)
    failures.extend(model_problems(entry.request.get("model"), cold, warm))

    # On both answers, whatever the comparison said: a benign divergence never excuses wrong content.
    expectation_violations, unjudged_content = content_problems(
        entry, evidence.complete_answer_checks, cold, warm
    )
    failures.extend(expectation_violations)
    unproven.extend(unjudged_content)

    prompt_tokens = cold.prompt_tokens if cold is not None else None
    expected = expected_hit_for(config, prompt_tokens)
    delta = evidence.after.delta(evidence.before) if evidence.after and evidence.before else None
    fallen = fallen_counters(evidence.before, evidence.after) if evidence.after and evidence.before else ""
    if warm is not None and delta is not None and not fallen:
        failures = [_with_store_load_failure(reason, warm, delta) for reason in failures]
    hit_evidence = None
    if cold is not None and cold.ok and warm is not None and warm.ok:
        unproven.extend(_cold_reference(evidence))
    if warm is not None and warm.ok:
        if evidence.metrics_error is not None:
            if evidence.metrics_error.kind is ErrorKind.CONNECTION:
                connection_error = connection_error or evidence.metrics_error.message
            load_unproven.append(f"reader's counters unavailable: {evidence.metrics_error.message}")
        elif fallen:
            load_unproven.append(
                f"reader's counters went down between the reads ({fallen}): the replica restarted "
                "during the pair, so its rise is no evidence"
            )
        elif delta is not None and evidence.after is not None:
            if config.block_size is not None and prompt_tokens is None:
                load_unproven.append(
                    "the cold answer has no usage.prompt_tokens: the exact hit demanded by the block size "
                    "cannot be computed (a vLLM OpenAI server always sends usage; a proxy dropped it?)"
                )
            proof = load_proof(
                warm, delta, evidence.after, expected, eagle=config.eagle, block_size=config.block_size
            )
            load_unproven.extend(proof.unproven)
            notes.extend(proof.notes)
            hit_evidence = proof.source if not load_unproven else None
    writer_delta = _writer_delta(evidence)
    if load_unproven:
        load_unproven.extend(put_wait_notes(evidence.put_wait, writer_delta))  # explains the reader's miss
    elif evidence.put_wait is not None and evidence.put_wait.outcome is PutWaitOutcome.TIMEOUT:
        notes.append(
            "the writer's puts were not all reported in time, yet the reader loaded the prefix: "
            + evidence.put_wait.describe()
        )

    reasons = failures + unproven + load_unproven
    verdict = Verdict.FAILED if failures else Verdict.INCONCLUSIVE if reasons else Verdict.PASSED
    return PairResult(
        index=evidence.index,
        writer=evidence.writer,
        reader=evidence.reader,
        cache_salt=evidence.cache_salt,
        verdict=verdict,
        reasons=reasons,
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
        answers_equal=comparison.proven_equal if comparison is not None else None,
        mismatch=comparison.mismatch if comparison is not None else None,
        divergence=comparison.divergence if comparison is not None else None,
        logprob_evidence=comparison.evidence if comparison is not None else None,
        shared_text=evidence.shared_text,
        put_wait=evidence.put_wait,
        hit_evidence=hit_evidence,
        only_load_unproven=verdict is Verdict.INCONCLUSIVE and not unproven,
        request_name=entry.name,
        expectation_violations=expectation_violations,
        connection_error=connection_error,
        wall_s=evidence.wall_s,
        request_latency_s=_request_latency(evidence),
        writer_metrics_reads=evidence.writer_metrics_reads,
    )


def content_problems(
    entry: SuiteEntry,
    complete_checks: tuple[Expectation, ...],
    cold: ChatAnswer | None,
    warm: ChatAnswer | None,
) -> tuple[list[str], list[str]]:
    """(violations, why content was not judged) of both answers. The request's expectations judge the
    answer after any reasoning; an answer cut at its token budget (finish_reason length) never reached
    its end, so its checks cannot be judged (Inconclusive, never a false Failed). A request without
    expectations of its own is judged by `complete_checks` where its answer is complete, else on its
    tokens alone."""
    violations_found: list[str] = []
    unjudged: list[str] = []
    checks: list[Expectation] = list(entry.expectations or [])
    own = bool(checks)
    if not own:
        checks = list(complete_checks)
    if not checks:
        return [], []
    for role, answer in (("cold", cold), ("warm", warm)):
        if answer is None or not answer.ok:
            continue
        if answer.truncated:
            if own:
                unjudged.append(
                    f"the {role} answer stopped at its token budget (finish_reason length) before it ended: "
                    "its content checks cannot be judged (raise the request's max_tokens; a reasoning model "
                    "needs room for its reasoning and the answer)"
                )
            continue
        violations_found += [
            f"{role} answer: {problem}"
            for problem in violations(checks, answer_text(answer.text, answer.reasoning))
        ]
    return violations_found, unjudged


def _cold_reference(evidence: PairMeasurement) -> list[str]:
    cold = evidence.cold
    assert cold is not None
    before = evidence.writer_before
    after = evidence.writer_after_cold or evidence.writer_after
    delta = None
    unavailable = f"could not be read ({evidence.writer_error})" if evidence.writer_error else "were not read"
    if before is not None and after is not None:
        fallen = fallen_counters(before, after)
        if fallen:
            unavailable = f"went down ({fallen}): the writer restarted"
        else:
            delta = after.delta(before)
    return cold_problems(cold, delta, after if delta is not None else None, unavailable)


def model_problems(asked: object, cold: ChatAnswer | None, warm: ChatAnswer | None) -> list[str]:
    """An answer that names another model than the request asked for is not an answer to it."""
    if not isinstance(asked, str):
        return []
    return [
        f"{role} answer names model {answer.model!r}, the request asked for {asked!r}"
        for role, answer in (("cold", cold), ("warm", warm))
        if answer is not None and answer.ok and answer.model is not None and answer.model != asked
    ]


def _writer_delta(evidence: PairMeasurement) -> StoreCounters | None:
    before, after = evidence.writer_before, evidence.writer_after
    if before is None or after is None or fallen_counters(before, after):
        return None
    return after.delta(before)


def without_secrets(result: CanaryResult, urls: list[str]) -> CanaryResult:
    """`result` with every replica URL's credentials replaced by `***`, wherever a message quoted them
    (an error that echoed a URL, a body that echoed a request): the last guard after each message
    redacted its own URL."""
    secrets = sorted(_userinfo_forms(urls), key=len, reverse=True)
    if not secrets:
        return result

    def scrub(value: Any) -> Any:
        if isinstance(value, str):
            for secret in secrets:
                value = value.replace(secret, "***")
            return value
        if isinstance(value, dict):
            return {key: scrub(item) for key, item in value.items()}
        if isinstance(value, list):
            return [scrub(item) for item in value]
        return value

    return CanaryResult.model_validate(scrub(result.model_dump(mode="python")))


def _userinfo_forms(urls: list[str]) -> set[str]:
    """Each URL's `user:password` and password, as written and percent-decoded (never empty)."""
    forms: set[str] = set()
    for url in urls:
        parts = urlsplit(url)
        if "@" not in parts.netloc:
            continue
        userinfo = parts.netloc.rpartition("@")[0]
        password = userinfo.partition(":")[2]
        forms.update(form for form in (userinfo, unquote(userinfo), password, unquote(password)) if form)
    return forms


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
    """The pair's requests from send to last byte, except the reads while waiting for the writer's puts
    (in `PutWait.waited_s`, with the pauses between them)."""
    latencies = [answer.latency_s for answer in (evidence.cold, evidence.warm) if answer is not None]
    latencies += [
        counters.latency_s
        for counters in (evidence.before, evidence.after, evidence.writer_before)
        if counters is not None
    ]
    if evidence.shared_text is not None:
        latencies.append(evidence.shared_text.latency_s)
    if evidence.metrics_error is not None:
        latencies.append(evidence.metrics_error.latency_s)
    return sum(latencies)
