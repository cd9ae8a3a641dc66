"""The revision-change proof: can a replica of a new revision be served blocks the old revision stored?

vLLM (0.32) keys a Mooncake store block by `[cache_prefix@]<basename of --model>@tp_rank@...@<block
hash>`: nothing of the weights' revision enters the key, and a request without a `cache_salt` (every
user's) hashes the same on every revision. So, on real engines and one real master:

1. Both replicas run revision 1. The request WITHOUT a salt goes to the first (cold: it stores the
   prefix), then to the second: its external hit must rise (revision-1 replicas share the store).
2. The second replica moves to revision 2 (other weights, a directory of the same basename; the spec's
   model.revision changes, and with it the KV fingerprint).
3. The same unsalted request goes to the first replica again, as users' traffic does during a rollout
   (it also puts back whatever blocks the store lost with the moved replica's segment).
4. The unsalted request goes to the moved replica, then the request with a fresh salt: its own cold
   answer. Passed: the two answers are equal and the unsalted one loaded nothing from the store.
   Failed: it loaded blocks it never wrote (another revision's), or its answer differs from its cold
   one: a stale answer was served. Inconclusive: step 1 never showed the store shared the prefix.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import httpx

from mooncake_operator.canary.client import CounterScrapeError, chat, scrape_counters
from mooncake_operator.canary.models import CanaryConfig, ChatAnswer, StoreCounters, Verdict
from mooncake_sandbox.errors import SandboxError
from mooncake_sandbox.runtime import Sandbox

NEW_REVISION = 2


class RevisionChangeError(SandboxError):
    """The scenario could not be exercised (a request failed, counters unreadable)."""


@dataclass(frozen=True)
class Served:
    """One request to one replica and how much the replica's counters rose meanwhile."""

    replica: str
    answer: ChatAnswer
    counters: StoreCounters

    @property
    def external_hit_tokens(self) -> int:
        return self.counters.external_hit_tokens or 0

    def as_json(self) -> dict[str, object]:
        return {
            "replica": self.replica,
            "text": self.answer.text,
            "latency_s": round(self.answer.latency_s, 2),
            "external_hit_tokens": self.external_hit_tokens,
            "store_keys": self.counters.store_keys_by_operation,
        }


@dataclass(frozen=True)
class RevisionChangeReport:
    store_isolation: bool
    key_namespaces: dict[str, str]  # replica@revision -> its store key namespace
    shared: Served  # step 1: revision-1 reader, unsalted
    stale_candidate: Served  # step 4: revision-2 replica, unsalted
    cold: Served  # step 4: revision-2 replica, fresh salt
    move_s: float  # step 2: restart of the moved replica until it is usable again

    @property
    def verdict(self) -> Verdict:
        return Verdict.INCONCLUSIVE if self.shared.external_hit_tokens == 0 else self._judged[0]

    @property
    def _judged(self) -> tuple[Verdict, str]:
        stale, cold = self.stale_candidate, self.cold
        loaded = stale.external_hit_tokens
        if stale.answer.text != cold.answer.text:
            return Verdict.FAILED, (
                f"a stale answer was served: the revision-{NEW_REVISION} replica's answer to the unsalted "
                f"request (after loading {loaded} tokens from the store) differs from its own cold answer"
            )
        if loaded:
            return Verdict.FAILED, (
                f"the revision-{NEW_REVISION} replica loaded {loaded} tokens it never stored (revision 1's "
                "blocks); its answer happened to equal its cold one"
            )
        return Verdict.PASSED, (
            f"the revision-{NEW_REVISION} replica loaded nothing of revision 1's blocks and its answer to "
            "the unsalted request equals its own cold answer"
        )

    def summary(self) -> str:
        isolation = "on" if self.store_isolation else "off"
        if self.shared.external_hit_tokens == 0:
            return (
                f"store isolation {isolation}: inconclusive: the revision-1 replicas did not share the "
                "unsalted prefix through the store (no external hit), so nothing stale could be offered"
            )
        return (
            f"store isolation {isolation}: revision-1 replicas shared the unsalted prefix "
            f"({self.shared.external_hit_tokens} tokens from the store); {self._judged[1]}"
        )

    def as_json(self) -> dict[str, object]:
        return {
            "store_isolation": self.store_isolation,
            "key_namespaces": self.key_namespaces,
            "revision_1_shared": self.shared.as_json(),
            "revision_2_unsalted": self.stale_candidate.as_json(),
            "revision_2_cold": self.cold.as_json(),
            "move_s": round(self.move_s, 1),
            "verdict": self.verdict.value,
            "summary": self.summary(),
        }


async def prove_revision_change(
    sandbox: Sandbox, client: httpx.AsyncClient, config: CanaryConfig
) -> RevisionChangeReport:
    """Steps 1-4 above on the sandbox's first two replicas (both must start at revision 1)."""
    first, moved = sandbox.replicas[0], sandbox.replicas[1]
    if first.revision != 1 or moved.revision != 1:
        raise RevisionChangeError("the revision-change scenario starts with every replica at revision 1")

    async def serve(index: int, salt: str | None) -> Served:
        replica = sandbox.replicas[index]
        before = await _counters(client, replica.url, config)
        answer = await chat(
            client, replica.url, config.request, cache_salt=salt, timeout=config.request_timeout_s
        )
        if not answer.ok:
            raise RevisionChangeError(f"{replica.name} did not answer: {answer.error or answer.status}")
        after = await _counters(client, replica.url, config)
        return Served(f"{replica.name}@revision-{replica.revision}", answer, after.delta(before))

    await serve(0, None)
    shared = await serve(1, None)
    sandbox.progress.phase(
        f"revision 1: {moved.name} loaded {shared.external_hit_tokens} tokens of the unsalted prefix "
        f"from the store; moving it to revision {NEW_REVISION}"
    )
    namespaces = {f"{moved.name}@revision-1": sandbox.key_namespace(moved)}
    move_started = time.monotonic()
    await sandbox.restart_replica(moved.index, revision=NEW_REVISION)
    move_s = time.monotonic() - move_started
    namespaces[f"{first.name}@revision-1"] = sandbox.key_namespace(first)
    namespaces[f"{moved.name}@revision-{NEW_REVISION}"] = sandbox.key_namespace(moved)
    await serve(0, None)
    stale = await serve(1, None)
    cold = await serve(1, f"sandbox-revision-change-{uuid.uuid4().hex}")
    return RevisionChangeReport(
        store_isolation=sandbox.options.store_isolation,
        key_namespaces=namespaces,
        shared=shared,
        stale_candidate=stale,
        cold=cold,
        move_s=move_s,
    )


async def _counters(client: httpx.AsyncClient, url: str, config: CanaryConfig) -> StoreCounters:
    try:
        return await scrape_counters(client, url, timeout=config.metrics_timeout_s)
    except CounterScrapeError as error:
        raise RevisionChangeError(f"cannot read the store counters of {url}: {error}") from error
