"""A reasoning model on real engines: the canary passes the patched engine and fails the buggy one, with and
without vLLM's `minimax_m2` reasoning parser.

One sandbox (real mooncake_master, two real vLLM CPU replicas A and B, Eagle-3 draft) serves the tiny
target's reasoning variant (sandbox/mooncake_sandbox/reasoning_model.py): its chat template opens the think
block, the model writes `</think>` and then its answer, as MiniMax-M2.5 does. The parser is production's
knob, `--reasoning-parser minimax_m2` in spec.engine.extraArgs; each test states the engine and the parser
it needs and only the replicas that differ are restarted.

With the parser vLLM splits every answer into `reasoning` and `content`; an answer whose budget ends before
`</think>` (the default suite's 32 tokens may) has a null `content` beside its reasoning. Without it the
content holds `…</think>answer`. Either way cold and warm must agree token for token on the patched engine,
and the buggy engine's uninitialised block must still be called corruption (issue 31, class 9: the canary
used to call the parsed answers malformed and fail a healthy rollout).
"""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from tests.support.cpu_stalls import stalled_during_test

from mooncake_operator.canary.models import CanaryConfig, CanaryResult, DivergenceKind, Verdict
from mooncake_operator.canary.report import render_table
from mooncake_operator.canary.runner import run_canary
from mooncake_sandbox import EngineMode, Prepared, Sandbox, SandboxOptions, start_sandbox

# A failed test runs again, at most twice, only when a CPU of this machine stalled while it ran
# (tests/support/cpu_stalls.py; docs/sandbox.md): any other failure fails at once.
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(900),
    pytest.mark.flaky(reruns=2, condition=stalled_during_test),
]

BLOCK_SIZE = 32
PARSER = "minimax_m2"
THINK_END = "</think>"
SUITE = ["request", "block-end", "block-plus-one", "block-minus-one", "many-blocks"]
# The suite's longest prefix: alone, a missing block among its 16 can fall inside the benign thresholds
# (tests/e2e/test_customer_reproduction.py, bench/RESULTS.md); the short prefixes carry the verdict.
LONG_PREFIX = "many-blocks"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sandbox(prepared: Prepared) -> AsyncIterator[Sandbox]:
    # Our own run directory, kept: the engines' logs are the evidence when a step fails.
    run_dir = Path(tempfile.mkdtemp(prefix="mooncake-e2e-reasoning-"))
    options = SandboxOptions(
        replicas=2,
        engine=EngineMode.PATCHED,
        speculative=True,
        reasoning_model=True,
        reasoning_parser=PARSER,
        run_dir=run_dir,
    )
    async with start_sandbox(options, prepared=prepared) as running:
        yield running


async def configure(sandbox: Sandbox, engine: EngineMode, parser: str | None) -> None:
    """Both replicas on `engine` with `parser` (None: none); restarts only those that differ."""
    stale = [
        r.index
        for r in sandbox.replicas
        if (r.engine, r.reasoning_parser) != (engine, parser)
        or r.process is None
        or r.process.exit_code() is not None
    ]
    if stale:
        await sandbox.restart_replicas(stale, engine=engine, reasoning_parser=parser)


def suite_config(sandbox: Sandbox) -> CanaryConfig:
    """The sandbox's canary (content checks off: the tiny model answers gibberish) with the default suite."""
    return sandbox.canary_config(eagle=True).model_copy(update={"suite": "default"})


def assert_passed_on_every_pair(result: CanaryResult) -> None:
    assert result.verdict is Verdict.PASSED, render_table(result)
    assert result.requests == SUITE and len(result.pairs) == 2 * len(SUITE), result.requests
    for pair in result.pairs:
        where = f"{pair.request_name} {pair.writer} -> {pair.reader}"
        assert pair.verdict is Verdict.PASSED, where
        assert pair.answers_equal is True and pair.divergence is None, where
        hit = pair.external_hit_tokens
        assert hit == pair.expected_external_hit_tokens and hit is not None, where
        assert pair.load_get_keys == hit // BLOCK_SIZE, "the fixed load_mask fetches every counted block"


def assert_corruption(result: CanaryResult) -> None:
    """Failed; every pair with the double-prune signature, each short prefix's divergence corruption."""
    assert result.verdict is Verdict.FAILED, render_table(result)
    assert result.requests == SUITE and len(result.pairs) == 2 * len(SUITE), result.requests
    for pair in result.pairs:
        where = f"{pair.request_name} {pair.writer} -> {pair.reader}"
        hit = pair.external_hit_tokens
        assert hit == pair.expected_external_hit_tokens and hit is not None and hit >= 2 * BLOCK_SIZE, where
        assert pair.load_get_keys == hit // BLOCK_SIZE - 1, where  # one block fewer loaded than counted
        if pair.request_name == LONG_PREFIX and pair.verdict is Verdict.PASSED:
            # Reported, never silent: the divergence and its margins are in the result.
            assert pair.divergence is not None and pair.divergence.kind is DivergenceKind.BENIGN, where
            continue
        assert pair.verdict is Verdict.FAILED, (where, pair.reasons)
        # Judged on the answers (tokens and logprobs), never "malformed": the reasoning is an answer.
        assert not any("malformed" in reason for reason in pair.reasons), (where, pair.reasons)
        if pair.divergence is not None:
            assert pair.divergence.kind is DivergenceKind.CORRUPTION, (where, pair.divergence)


def cold_answers(result: CanaryResult) -> dict[str, tuple[str | None, str | None]]:
    """(reasoning, content) of the first pair's cold answer per request."""
    answers: dict[str, tuple[str | None, str | None]] = {}
    for pair in result.pairs:
        if pair.request_name not in answers and pair.cold is not None:
            answers[pair.request_name] = (pair.cold.reasoning, pair.cold.text)
    return answers


def assert_split_by_the_parser(result: CanaryResult) -> None:
    """Every answer starts in the reasoning; the reference request (80 tokens) reaches its answer."""
    answers = cold_answers(result)
    for name, (reasoning, content) in answers.items():
        assert reasoning, (name, content)
        assert THINK_END not in reasoning, name
    reasoning, content = answers["request"]
    assert content, f"the reference request must reach its answer after {THINK_END}: {reasoning!r}"
    # Whichever suite answers ended inside their reasoning (content null) were judged, not malformed.
    ended_in_reasoning = [name for name, (_, content) in answers.items() if content is None]
    print(f"answers whose budget ended inside the reasoning (content null): {ended_in_reasoning}")


def assert_unsplit(result: CanaryResult) -> None:
    """Without a parser the reasoning stays in the content: `…</think>answer` on the reference request."""
    answers = cold_answers(result)
    for name, (reasoning, content) in answers.items():
        assert reasoning is None and content is not None, name
    assert THINK_END in (answers["request"][1] or "")


async def test_patched_engines_with_the_reasoning_parser_pass(sandbox: Sandbox) -> None:
    await configure(sandbox, EngineMode.PATCHED, PARSER)

    result = await sandbox.guard(run_canary(suite_config(sandbox)))

    assert_passed_on_every_pair(result)
    assert_split_by_the_parser(result)


# Slow (scripts/test-slow): without a parser the generation is the same tokens in one field; the unit
# tier (tests/unit/test_canary_divergence.py, test_canary_expectations.py) proves the rules on such answers.
@pytest.mark.slow
async def test_patched_engines_without_a_parser_pass(sandbox: Sandbox) -> None:
    await configure(sandbox, EngineMode.PATCHED, None)

    result = await sandbox.guard(run_canary(suite_config(sandbox)))

    assert_passed_on_every_pair(result)
    assert_unsplit(result)


async def test_the_buggy_engine_without_a_parser_fails(sandbox: Sandbox) -> None:
    await configure(sandbox, EngineMode.BUGGY, None)

    result = await sandbox.guard(run_canary(suite_config(sandbox)))

    assert_corruption(result)
    request_pairs = [pair for pair in result.pairs if pair.request_name == "request"]
    assert all(pair.verdict is Verdict.FAILED for pair in request_pairs)
    for pair in request_pairs:
        assert pair.cold is not None and pair.cold.reasoning is None and THINK_END in (pair.cold.text or "")


# Slow (scripts/test-slow): the corruption is decided on tokens and logprobs, which a parser does not
# change; this proves it on real engines with the parser's split answers.
@pytest.mark.slow
async def test_the_buggy_engine_with_the_reasoning_parser_fails(sandbox: Sandbox) -> None:
    await configure(sandbox, EngineMode.BUGGY, PARSER)

    result = await sandbox.guard(run_canary(suite_config(sandbox)))

    assert_corruption(result)
    assert all(pair.verdict is Verdict.FAILED for pair in result.pairs if pair.request_name == "request")
    for pair in result.pairs:
        assert pair.cold is not None and pair.cold.reasoning, pair.request_name
