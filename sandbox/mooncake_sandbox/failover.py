"""The failover proof: kill the leading master while the store holds a prefix, then prove the store again.

1. A "pre-failover" prefix: the canary's request with a salt of its own goes to the first replica (cold);
   its store `save_put` keys must rise, i.e. the store holds the prefix. The second replica has never
   seen that salt.
2. The leading master is killed (SIGKILL), and the sandbox waits until a standby leads and serves
   (Mooncake's own /health says so).
3. Fresh pairs (writer -> reader, a new salt each) are tried until one passes as a canary pair: the
   failover time is "leader killed -> a warm load succeeds again" (`warm_load_after_s`).
4. The pre-failover prefix is then sent to the second replica (its counters read just before, so only
   this request counts), and the pair (cold answer from before the
   failover, warm answer from after it) is judged by the canary's own rules: with the oplog it must
   pass (warm == cold, external hit as expected); without it the new leader knows nothing of it and the
   pair shows no external hit: the prefix is lost (Inconclusive, stated, never hidden).

Only the planned election may happen in between: the leader and its view are read when the prefix is
stored and again just before the kill (they must be the same), and when the new leader serves and
again after the prefix is read back (with the oplog, a prefix that did not load across a second,
unplanned election is about that election). Either change raises UnplannedLeaderChange, and the caller
runs the proof again from step 1 (`ha.redo_after_unplanned_leader_changes`), reporting it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import httpx

from mooncake_operator.canary.client import CounterScrapeError, scrape_counters
from mooncake_operator.canary.models import CanaryConfig, PairResult, StoreCounters, Verdict
from mooncake_operator.canary.runner import PairMeasurement, judge_pair, measure_pair, send_chat
from mooncake_sandbox.errors import SandboxError, SandboxSetupError
from mooncake_sandbox.ha import LeaderChange, UnplannedLeaderChange
from mooncake_sandbox.runtime import Sandbox

SAVE_PUT = "save_put"
WARM_LOAD_TIMEOUT_S = 300.0


class FailoverError(SandboxError):
    """The failover could not be exercised (e.g. the writer's store never held the prefix)."""


@dataclass(frozen=True)
class FailoverReport:
    killed: str
    killed_address: str
    new_leader: str
    new_leader_address: str
    new_leader_after_s: float  # leader killed -> a standby leads and serves (its /health)
    warm_load_after_s: float  # leader killed -> a fresh pair passes (the failover time)
    fresh_pair_attempts: int
    enable_oplog: bool
    preserved: PairResult  # the prefix stored before the failover, loaded after it

    @property
    def verdict(self) -> Verdict:
        return self.preserved.verdict

    def summary(self) -> str:
        kept = self.preserved
        if kept.verdict is Verdict.PASSED:
            what = (
                f"the prefix stored before the failover loaded after it ({kept.external_hit_tokens} tokens "
                "from the store) and the warm answer equals the cold one"
            )
        elif kept.verdict is Verdict.INCONCLUSIVE:
            what = f"the prefix stored before the failover was NOT loaded after it: {'; '.join(kept.reasons)}"
        else:
            what = f"the prefix stored before the failover gave a wrong answer: {'; '.join(kept.reasons)}"
        return (
            f"killed leader {self.killed} ({self.killed_address}); {self.new_leader} "
            f"({self.new_leader_address}) led after {self.new_leader_after_s:.1f} s; a warm load succeeded "
            f"again after {self.warm_load_after_s:.1f} s ({self.fresh_pair_attempts} fresh pair(s)); "
            f"oplog {'on' if self.enable_oplog else 'off'}: {what}"
        )

    def as_json(self) -> dict[str, object]:
        return {
            "killed": self.killed,
            "killed_address": self.killed_address,
            "new_leader": self.new_leader,
            "new_leader_address": self.new_leader_address,
            "new_leader_after_s": round(self.new_leader_after_s, 2),
            "warm_load_after_s": round(self.warm_load_after_s, 2),
            "fresh_pair_attempts": self.fresh_pair_attempts,
            "enable_oplog": self.enable_oplog,
            "preserved_prefix": self.preserved.model_dump(mode="json"),
            "summary": self.summary(),
        }


async def prove_failover(sandbox: Sandbox, client: httpx.AsyncClient, config: CanaryConfig) -> FailoverReport:
    """Steps 1-4 above; raises FailoverError/SandboxSetupError when the scenario cannot be exercised."""
    ha = sandbox.ha
    if ha is None:
        raise SandboxSetupError(
            "the failover proof needs highly available masters (SandboxOptions.ha_masters)"
        )
    if ha.alive_count() < 2:
        raise SandboxSetupError(
            f"the failover proof needs a standby master to take over; {ha.alive_count()} master(s) left"
        )
    writer, reader = config.replicas[0], config.replicas[1]
    salt = f"sandbox-before-failover-{uuid.uuid4().hex}"
    stored_under = await ha.epoch(client)
    writer_before = await _counters(client, writer, config)
    # Sent as the canary sends them (logprobs by token id included): judged by the canary's rules below.
    cold = await send_chat(client, writer, config, salt=salt)
    if not cold.ok:
        raise FailoverError(f"the pre-failover prefix could not be written: {cold.error or cold.status}")
    stored = (
        (await _counters(client, writer, config))
        .delta(writer_before)
        .store_keys_by_operation.get(SAVE_PUT, 0)
    )
    if stored <= 0:
        raise FailoverError(
            f"{writer} answered but its store {SAVE_PUT} keys did not rise: nothing to fail over"
        )

    at_kill = await ha.epoch(client)
    if at_kill != stored_under:
        change = LeaderChange("the failover proof, before the kill", stored_under, at_kill)
        raise UnplannedLeaderChange(change)
    leader = at_kill.node
    sandbox.progress.phase(f"the store holds the prefix ({stored} keys); killing the leader {leader.name}")
    killed_at = time.monotonic()
    ha.kill(leader)
    new_epoch = await ha.epoch(client)
    new_leader = new_epoch.node
    new_leader_after = time.monotonic() - killed_at
    sandbox.progress.phase(f"{new_leader.name} leads after {new_leader_after:.1f} s; trying fresh pairs")

    attempts = await wait_for_a_warm_load(sandbox, client, config, since=killed_at)
    warm_load_after = time.monotonic() - killed_at

    # Read now, not before the failover: the fresh pairs' loads must not count for this prefix.
    reader_before = await _counters(client, reader, config)
    warm = await send_chat(client, reader, config, salt=salt)
    reader_after = await _counters(client, reader, config) if warm.ok else None
    evidence = PairMeasurement(
        index=0,
        writer=writer,
        reader=reader,
        cache_salt=salt,
        cold=cold,
        warm=warm,
        before=reader_before,
        after=reader_after,
        metrics_error=None,
        wall_s=time.monotonic() - killed_at,
    )
    preserved = judge_pair(evidence, config)
    if preserved.verdict is not Verdict.PASSED and ha.topology.enable_oplog:
        now = await ha.epoch(client)
        if now != new_epoch:
            raise UnplannedLeaderChange(LeaderChange("the failover proof, after the kill", new_epoch, now))
    return FailoverReport(
        killed=leader.name,
        killed_address=leader.address,
        new_leader=new_leader.name,
        new_leader_address=new_leader.address,
        new_leader_after_s=new_leader_after,
        warm_load_after_s=warm_load_after,
        fresh_pair_attempts=attempts,
        enable_oplog=ha.topology.enable_oplog,
        preserved=preserved,
    )


async def wait_for_a_warm_load(
    sandbox: Sandbox, client: httpx.AsyncClient, config: CanaryConfig, *, since: float
) -> int:
    """Fresh pairs until one passes as a canary pair: the store serves again after an election (the
    replicas mount their segments at the new leader). Returns the number of pairs tried."""
    attempts = 0
    while True:
        attempts += 1
        fresh = await _fresh_pair(client, config, attempts)
        if fresh.verdict is Verdict.PASSED:
            return attempts
        sandbox.progress.phase(f"fresh pair {attempts}: {fresh.verdict.value} ({'; '.join(fresh.reasons)})")
        if fresh.verdict is Verdict.FAILED or time.monotonic() - since > WARM_LOAD_TIMEOUT_S:
            raise FailoverError(
                f"no warm load succeeded within {time.monotonic() - since:.0f} s of the election; "
                f"last pair {fresh.verdict.value}: {'; '.join(fresh.reasons)}"
            )


async def _fresh_pair(client: httpx.AsyncClient, config: CanaryConfig, attempt: int) -> PairResult:
    """A canary pair with a salt of its own, measured and judged exactly as the canary does."""
    salt = f"sandbox-after-failover-{attempt}-{uuid.uuid4().hex}"
    writer, reader = config.replicas[0], config.replicas[1]
    evidence = await measure_pair(client, config, index=attempt, writer=writer, reader=reader, salt=salt)
    return judge_pair(evidence, config)


async def _counters(client: httpx.AsyncClient, url: str, config: CanaryConfig) -> StoreCounters:
    try:
        return await scrape_counters(client, url, timeout=config.metrics_timeout_s)
    except CounterScrapeError as error:
        raise FailoverError(f"cannot read the store counters of {url}: {error}") from error
