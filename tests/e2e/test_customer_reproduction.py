"""The customer's four steps on real engines, then the patcher's fix, then the canary on both engines.

One sandbox (real mooncake_master, two real vLLM CPU replicas A and B, tiny target + Eagle-3 draft) is
shared by the whole module; each test states the engine configuration it needs and only the replicas
that differ are restarted. A fresh `cache_salt` does the work of the customer's "empty Mooncake
store": it is mixed into the first block's hash, so a new salt makes every block key new.

Measured facts these tests pin down (vLLM 0.32 CPU, block size 32, the customer's request = 168
prompt tokens with the tiny tokenizer): an Eagle reader loads 128 tokens (the lookup drops the last
of 5 full blocks for the drafter); the pre-fix `load_mask` drops it a second time, so the connector
fetches 3 blocks where the scheduler counted 4 and the warm answer is computed over one block of
uninitialised KV.

The canaries here run the default suite (the customer's request and four requests padded to a block
boundary, one past, one short and many blocks) and judge by logprobs. A reader serving the target
with its logits moved by at most PERTURB_NATS (sandbox/perturbed_model.py: GPU-like numerics, KV
unchanged) stands in for a benign divergence: on the patched engine it passes with the divergence
reported; on the buggy one the corruption is still called corruption.
"""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from tests.support.cpu_stalls import stalled_during_test

from mooncake_operator.canary.client import chat, scrape_counters
from mooncake_operator.canary.metrics import expected_external_hit_tokens
from mooncake_operator.canary.models import (
    CanaryConfig,
    CanaryResult,
    ChatAnswer,
    DivergenceKind,
    StoreCounters,
    Verdict,
)
from mooncake_operator.canary.report import render_json, render_table
from mooncake_operator.canary.request import reference_request
from mooncake_operator.canary.runner import run_canary
from mooncake_sandbox import (
    EngineMode,
    MasterDownError,
    Prepared,
    ReplicaDiedError,
    Sandbox,
    SandboxOptions,
    SandboxSetupError,
    start_sandbox,
)
from mooncake_sandbox.engines import patcher_script

# A failed test runs again, at most twice, with fresh salts, only when a CPU of this machine stalled
# while it ran (tests/support/cpu_stalls.py; docs/sandbox.md): any other failure, a wrong answer above
# all, fails at once. pytest reports every rerun.
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(900),
    pytest.mark.flaky(reruns=2, condition=stalled_during_test),
]

A, B = 0, 1
BLOCK_SIZE = 32
TIMEOUT_S = 300.0
COORDINATOR = Path("distributed/kv_transfer/kv_connector/v1/mooncake/store/coordinator.py")
# The reader's perturbation bound: the smallest that tipped near ties in more than one suite request
# of the tiny model (bench/perturbation_probe.py, bench/RESULTS.md); its drift stays under the defaults.
PERTURB_NATS = 0.2
SUITE = ["request", "block-end", "block-plus-one", "block-minus-one", "many-blocks"]


@dataclass(frozen=True)
class Reference:
    """Step 1: the cold answer of replica A (buggy engine, Eagle on) and the salt it was stored under."""

    answer: ChatAnswer
    salt: str


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sandbox(prepared: Prepared) -> AsyncIterator[Sandbox]:
    # Our own run directory, kept: pytest's basetemp rotates away after three runs, and the engines'
    # logs are the evidence when a step fails. The path is printed at start-up.
    run_dir = Path(tempfile.mkdtemp(prefix="mooncake-e2e-sandbox-"))
    options = SandboxOptions(replicas=2, engine=EngineMode.BUGGY, speculative=True, run_dir=run_dir)
    async with start_sandbox(options, prepared=prepared) as running:
        yield running


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False) as shared:
        yield shared


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(sandbox: Sandbox, client: httpx.AsyncClient) -> Reference:
    await configure(sandbox, EngineMode.BUGGY, speculative=True)
    salt = fresh_salt("step1")
    answer, delta = await ask_and_count(sandbox, client, A, salt)
    assert delta.external_hit_tokens == 0, "a fresh salt must make replica A cold"
    return Reference(answer=answer, salt=salt)


def fresh_salt(label: str) -> str:
    return f"e2e-{label}-{uuid.uuid4().hex}"


async def configure(
    sandbox: Sandbox, engine: EngineMode, *, speculative: bool, perturbed_b: float | None = None
) -> None:
    """Both replicas on `engine` with or without Eagle, B's logits perturbed by at most `perturbed_b`
    nats (None: A's target); restarts only those that differ (concurrently)."""
    wanted = {A: None, B: perturbed_b}
    stale = [
        r.index
        for r in sandbox.replicas
        if (r.engine, r.speculative, r.perturb_nats) != (engine, speculative, wanted[r.index])
    ]
    if stale or any(r.process is None or r.process.exit_code() is not None for r in sandbox.replicas):
        dead = [r.index for r in sandbox.replicas if r.process is None or r.process.exit_code() is not None]
        await sandbox.restart_replicas(
            sorted({*stale, *dead}), engine=engine, speculative=speculative, perturb_nats=wanted
        )


async def ask(sandbox: Sandbox, client: httpx.AsyncClient, index: int, salt: str) -> ChatAnswer:
    url = sandbox.replica_urls[index]
    answer = await sandbox.guard(chat(client, url, reference_request(), cache_salt=salt, timeout=TIMEOUT_S))
    assert answer.ok, f"{sandbox.replicas[index].name}: {answer.error} {answer.body_excerpt or ''}"
    return answer


async def counters(sandbox: Sandbox, client: httpx.AsyncClient, index: int) -> StoreCounters:
    return await scrape_counters(client, sandbox.replica_urls[index], timeout=30)


async def ask_and_count(
    sandbox: Sandbox, client: httpx.AsyncClient, index: int, salt: str
) -> tuple[ChatAnswer, StoreCounters]:
    """The answer of replica `index` and how much its counters rose while it answered."""
    before = await counters(sandbox, client, index)
    answer = await ask(sandbox, client, index, salt)
    return answer, (await counters(sandbox, client, index)).delta(before)


def loads(delta: StoreCounters) -> int:
    return delta.store_keys_by_operation.get("load_get", 0)


# --- the customer's four steps, buggy engine -------------------------------------------------------


async def test_steps_1_to_3_warm_answer_on_b_is_corrupted_cold_answer_is_not(
    sandbox: Sandbox, client: httpx.AsyncClient, reference: Reference
) -> None:
    # (1) cold on A: the reference (fixture). (2) the identical request on B, which loads A's prefix.
    warm, delta = await ask_and_count(sandbox, client, B, reference.salt)
    expected_hit = expected_external_hit_tokens(reference.answer.prompt_tokens or 0, BLOCK_SIZE, eagle=True)

    assert warm.text != reference.answer.text, "with the pre-fix load_mask B's warm answer must differ"
    assert delta.external_hit_tokens == expected_hit == 128, "B must have loaded A's prefix from the store"
    assert delta.local_hit_tokens == 0, "nothing came from B's own cache"
    # The bug's signature: the connector fetched one block less than the scheduler counted as loaded.
    assert loads(delta) == expected_hit // BLOCK_SIZE - 1, delta.store_keys_by_operation

    # (3) "empty store" again (a fresh salt) and straight to B: its cold answer is correct.
    cold_b, delta_b = await ask_and_count(sandbox, client, B, fresh_salt("step3"))
    assert delta_b.external_hit_tokens == 0, "a fresh salt must make B cold"
    assert cold_b.text == reference.answer.text


def suite_config(sandbox: Sandbox) -> CanaryConfig:
    """The sandbox's canary with the default block-boundary suite."""
    return sandbox.canary_config(eagle=True).model_copy(update={"suite": "default"})


# The suite's longest prefix (15 blocks behind the missing one): alone, its divergence lies within about
# one bf16 step (0.016 nat) of the benign thresholds, and a reader perturbed by 0.2 nat tips it to benign
# (bench/RESULTS.md, "Over many salts"). A run's verdict rests on the short prefixes.
LONG_PREFIX = "many-blocks"


def assert_corruption_on_every_pair(result: CanaryResult, *, perturbed_reader: str | None = None) -> None:
    """Failed on every pair of every suite request, each divergence judged corruption, with its margins;
    with `perturbed_reader`, the long prefix's pair into that reader may instead be reported as benign (never
    silently: the divergence and its margins are in the result), and the run still fails."""
    assert result.verdict is Verdict.FAILED, render_table(result)
    assert result.requests == SUITE and len(result.pairs) == 2 * len(SUITE), result.requests
    for pair in result.pairs:
        where = f"{pair.request_name} {pair.writer} -> {pair.reader}"
        assert pair.answers_equal is False, where
        if pair.request_name == LONG_PREFIX and pair.reader == perturbed_reader:
            divergence = pair.divergence
            assert divergence is not None, where
            if divergence.kind is DivergenceKind.BENIGN:
                assert pair.verdict is Verdict.PASSED, where
                assert f"benign divergence at token {divergence.position}" in divergence.describe()
                hit = pair.external_hit_tokens
                assert hit == pair.expected_external_hit_tokens and hit is not None, where
                assert pair.load_get_keys == hit // BLOCK_SIZE - 1, where  # the bug's signature stays
                continue
        assert pair.verdict is Verdict.FAILED, where
        divergence = pair.divergence
        assert divergence is not None and divergence.kind is DivergenceKind.CORRUPTION, (where, divergence)
        assert divergence.reasons, where  # why it is not benign, each beyond its threshold
        assert divergence.max_tie_gap_nats_allowed > 0 and divergence.max_drift_nats_allowed > 0
        assert f"{divergence.kind.value} divergence at token {divergence.position}" in divergence.describe()
        # The bug's signature on every request, whatever its length: one block fewer loaded than counted.
        hit = pair.external_hit_tokens
        assert hit == pair.expected_external_hit_tokens and hit is not None and hit >= 2 * BLOCK_SIZE, where
        assert pair.load_get_keys == hit // BLOCK_SIZE - 1, where
    assert '"kind": "corruption"' in render_json(result)


async def test_canary_fails_on_the_buggy_engine(sandbox: Sandbox, reference: Reference) -> None:
    await configure(sandbox, EngineMode.BUGGY, speculative=True)

    result = await sandbox.guard(run_canary(suite_config(sandbox)))

    assert_corruption_on_every_pair(result)
    for pair in result.pairs:
        if pair.request_name == "request":
            assert pair.cold is not None and pair.cold.text == reference.answer.text
            assert pair.external_hit_tokens == 128 and pair.load_get_keys == 3
        assert any("double-prune signature" in note for note in pair.notes), pair.notes
    prompts = {pair.request_name: pair.prompt_tokens for pair in result.pairs}
    boundary = prompts["block-end"]
    assert boundary is not None and boundary % BLOCK_SIZE == 0
    assert (prompts["block-plus-one"], prompts["block-minus-one"]) == (boundary + 1, boundary - 1)
    assert result.cost.chat_requests == 2 * len(result.pairs)


# --- the periodic re-canary on replicas that serve users --------------------------------------------


@dataclass
class ReaderLoad:
    """Users' traffic that loads from the store, as a re-canary of a serving reader meets it: each user
    request is sent to A (it stores the prefix) and then to B (it loads it), with a salt of its own, so
    both replicas' replica-wide counters (puts, external hits, drafts) rise beside the canary's own."""

    sandbox: Sandbox
    client: httpx.AsyncClient
    sent: int = 0
    failed: int = 0
    b_external_hits_while_running: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            salt = fresh_salt("user")
            for index in (A, B):
                answer = await chat(
                    self.client,
                    self.sandbox.replica_urls[index],
                    reference_request(),
                    cache_salt=salt,
                    timeout=TIMEOUT_S,
                )
                self.sent += 1
                self.failed += 0 if answer.ok else 1


async def canary_under_reader_load(
    sandbox: Sandbox, client: httpx.AsyncClient
) -> tuple[CanaryResult, ReaderLoad]:
    """The canary (both directions, the configured request) while ReaderLoad runs; the load starts first
    and runs until the canary ended. Returns the result and how much user traffic ran beside it."""
    load = ReaderLoad(sandbox, client)
    stop = asyncio.Event()
    before = await counters(sandbox, client, B)
    users = asyncio.create_task(load.run(stop))
    try:
        while load.sent < 2:  # the users' first pair went through: their loads are in B's counters
            await sandbox.guard(asyncio.sleep(0.2))
        result = await sandbox.guard(run_canary(sandbox.canary_config(eagle=True)))
    finally:
        stop.set()
        await users
    load.b_external_hits_while_running = (await counters(sandbox, client, B)).delta(
        before
    ).external_hit_tokens or 0
    return result, load


def assert_proven_from_the_answers(result: CanaryResult, load: ReaderLoad) -> None:
    """The users' loads raised the replica-wide counters beyond the canary's own; the pairs' load evidence
    came from each warm answer's own usage (per request), never from those counters."""
    assert load.sent >= 2 and load.failed == 0, (load.sent, load.failed)
    b = load.sandbox.replica_urls[B]
    canary_hits = sum(pair.external_hit_tokens or 0 for pair in result.pairs if pair.reader == b)
    assert load.b_external_hits_while_running > canary_hits, "the users' loads did not overlap the canary"
    for pair in result.pairs:
        where = f"{pair.writer} -> {pair.reader}"
        assert pair.hit_evidence == "answer", (where, pair.hit_evidence, pair.reasons)
        assert pair.warm is not None and pair.warm.cached_tokens == pair.expected_external_hit_tokens, where
        assert pair.cold is not None and pair.cold.cached_tokens == 0, where
        assert pair.warm.spec_decoding is not None and pair.warm.spec_decoding.num_draft_tokens > 0, where


async def test_a_re_canary_under_users_store_traffic_fails_the_buggy_engine(
    sandbox: Sandbox, client: httpx.AsyncClient
) -> None:
    await configure(sandbox, EngineMode.BUGGY, speculative=True)

    result, load = await canary_under_reader_load(sandbox, client)

    assert result.verdict is Verdict.FAILED, render_table(result)
    assert all(pair.verdict is Verdict.FAILED for pair in result.pairs), render_table(result)
    assert_proven_from_the_answers(result, load)


# Slow (scripts/test-slow): the rule that a perturbation never excuses corruption is decided on measured
# evidence the unit tier feeds it (tests/unit/test_canary_adversarial.py); this proves it on real engines.
@pytest.mark.slow
async def test_a_perturbed_reader_does_not_make_a_buggy_run_pass(sandbox: Sandbox) -> None:
    await configure(sandbox, EngineMode.BUGGY, speculative=True, perturbed_b=PERTURB_NATS)

    result = await sandbox.guard(run_canary(suite_config(sandbox)))

    assert_corruption_on_every_pair(result, perturbed_reader=sandbox.replica_urls[B])


# Slow (scripts/test-slow): the speculative config is part of the KV fingerprint (unit tier:
# tests/unit/builders), so the two deployments read under different cache prefixes; this proves on real
# engines that the isolation is what keeps a reader without Eagle from the Eagle writer's blocks.
@pytest.mark.slow
async def test_a_reader_without_eagle_reads_nothing_an_eagle_writer_stored(
    sandbox: Sandbox, client: httpx.AsyncClient, reference: Reference
) -> None:
    await configure(sandbox, EngineMode.BUGGY, speculative=True)
    # B alone without Eagle must not read what an Eagle writer stored: those blocks also hold the draft
    # layer's KV (40 KiB where B expects 32 KiB; without isolation vLLM failed the request with a 500).
    # The speculative config is part of the KV fingerprint, so B reads under another cache_prefix:
    # it finds nothing of A's and answers cold, correctly.
    await sandbox.restart_replica(B, speculative=False, perturb_nats=None)
    mixed_salt = fresh_salt("step4-mixed")
    await ask(sandbox, client, A, mixed_salt)
    mixed, mixed_delta = await ask_and_count(sandbox, client, B, mixed_salt)
    assert mixed.text == reference.answer.text
    assert mixed_delta.external_hit_tokens == 0 and loads(mixed_delta) == 0


async def test_step_4_without_speculative_config_warm_answer_is_correct(
    sandbox: Sandbox, client: httpx.AsyncClient, reference: Reference
) -> None:
    # The customer's step 4: the deployment without the speculative config, prefix warmed on A, B warm.
    await configure(sandbox, EngineMode.BUGGY, speculative=False)
    salt = fresh_salt("step4")
    cold_a = await ask(sandbox, client, A, salt)
    warm, delta = await ask_and_count(sandbox, client, B, salt)
    expected_hit = expected_external_hit_tokens(cold_a.prompt_tokens or 0, BLOCK_SIZE, eagle=False)

    assert cold_a.text == reference.answer.text, "speculative decoding must not change greedy answers"
    assert warm.text == reference.answer.text
    assert delta.external_hit_tokens == expected_hit == 160
    assert loads(delta) == expected_hit // BLOCK_SIZE


# --- the fix ---------------------------------------------------------------------------------------


async def test_patched_engine_is_the_buggy_overlay_after_our_patcher(
    prepared: Prepared, tmp_path: Path
) -> None:
    buggy = prepared.builds[EngineMode.BUGGY]
    patched = prepared.builds[EngineMode.PATCHED]
    assert (buggy.patcher_status, patched.patcher_status) == ("buggy", "patched")
    # Apply the patcher to a copy of the buggy coordinator: byte for byte what the patched engine runs.
    copy = tmp_path / "vllm" / COORDINATOR
    copy.parent.mkdir(parents=True)
    copy.write_bytes((buggy.vllm_dir / COORDINATOR).read_bytes())
    (tmp_path / "vllm" / "__init__.py").write_text("")
    process = await asyncio.create_subprocess_exec(
        str(prepared.env.python), str(patcher_script()), "apply", "--vllm-dir", str(tmp_path / "vllm")
    )
    assert await process.wait() == 0
    assert copy.read_bytes() == (patched.vllm_dir / COORDINATOR).read_bytes()


async def test_after_the_patcher_step_2_equals_step_1(
    sandbox: Sandbox, client: httpx.AsyncClient, reference: Reference
) -> None:
    await configure(sandbox, EngineMode.PATCHED, speculative=True)
    salt = fresh_salt("patched")
    cold_a = await ask(sandbox, client, A, salt)
    warm, delta = await ask_and_count(sandbox, client, B, salt)

    assert cold_a.text == reference.answer.text
    assert warm.text == reference.answer.text
    assert delta.external_hit_tokens == 128
    assert loads(delta) == 4, "the fixed load_mask fetches every block the scheduler counted"


async def test_canary_passes_on_the_patched_engine(sandbox: Sandbox) -> None:
    await configure(sandbox, EngineMode.PATCHED, speculative=True)

    result = await sandbox.guard(run_canary(suite_config(sandbox)))

    assert result.verdict is Verdict.PASSED, render_table(result)
    assert result.requests == SUITE
    for pair in result.pairs:
        assert pair.answers_equal is True and pair.divergence is None, pair.request_name
        hit = pair.external_hit_tokens
        assert hit == pair.expected_external_hit_tokens and hit is not None, pair.request_name
        assert pair.load_get_keys == hit // BLOCK_SIZE, "the fixed load_mask fetches every counted block"
    assert [pair.external_hit_tokens for pair in result.pairs if pair.request_name == "request"] == [128, 128]


async def test_a_re_canary_under_users_store_traffic_passes_the_patched_engine(
    sandbox: Sandbox, client: httpx.AsyncClient
) -> None:
    await configure(sandbox, EngineMode.PATCHED, speculative=True)

    result, load = await canary_under_reader_load(sandbox, client)

    assert result.verdict is Verdict.PASSED, render_table(result)
    assert_proven_from_the_answers(result, load)


# Slow (scripts/test-slow): a benign divergence is judged on measured gaps the unit tier feeds the rules
# (tests/unit/test_canary_adversarial.py, test_canary_divergence.py); this proves it on real engines.
@pytest.mark.slow
async def test_a_perturbed_reader_on_the_patched_engine_passes_with_the_divergence_reported(
    sandbox: Sandbox,
) -> None:
    await configure(sandbox, EngineMode.PATCHED, speculative=True, perturbed_b=PERTURB_NATS)

    result = await sandbox.guard(run_canary(suite_config(sandbox)))

    assert result.verdict is Verdict.PASSED, render_table(result)
    diverged = [pair for pair in result.pairs if pair.divergence is not None]
    assert diverged, "the perturbation tips at least one near tie of the suite (bench/RESULTS.md)"
    for pair in diverged:
        divergence = pair.divergence
        assert divergence is not None and divergence.kind is DivergenceKind.BENIGN, divergence
        assert pair.answers_equal is False and pair.verdict is Verdict.PASSED
        gaps = (divergence.cold_gap_nats, divergence.warm_gap_nats)
        # A flip needs a gap no larger than what the bounded perturbation can move (2 bounds + rounding).
        assert all(gap is not None and gap <= divergence.max_tie_gap_nats_allowed for gap in gaps)
    assert '"kind": "benign"' in render_json(result)


# --- failures are clear and fast -------------------------------------------------------------------


async def test_a_replica_killed_mid_run_is_a_clear_failure_not_a_hang(sandbox: Sandbox) -> None:
    # The replicas as the re-canary under users' traffic left them: no restart.
    await configure(sandbox, EngineMode.PATCHED, speculative=True)
    victim = sandbox.replicas[B].process
    assert victim is not None
    config = sandbox.canary_config(eagle=True)
    asyncio.get_running_loop().call_later(1.0, os.kill, victim.pid, signal.SIGKILL)
    started = time.monotonic()

    with pytest.raises(ReplicaDiedError) as caught:
        await sandbox.guard(run_canary(config))

    assert time.monotonic() - started < 30
    assert f"replica-B (pid {victim.pid}" in str(caught.value)
    assert "exited with code -9" in str(caught.value)


async def test_master_down_is_a_clear_setup_error(sandbox: Sandbox) -> None:
    # Last in the module: the sandbox cannot recover a lost store.
    assert sandbox.master is not None
    os.kill(sandbox.master.pid, signal.SIGKILL)
    await asyncio.sleep(0.5)

    with pytest.raises(MasterDownError, match="is not running") as caught:
        sandbox.check_alive()
    assert isinstance(caught.value, SandboxSetupError)
    with pytest.raises(MasterDownError):
        await sandbox.restart_replica(A)
