"""One worker per MooncakeServing: reconcile when something changed, or when a timer is due.

A worker reconciles its resource, then sleeps until the first of: a change to the resource or one of
its children or pods (the watch cache calls `Wakes.poke` with the owner), the delay its outcome asks for
(an API error, waiting for pods or a leading master, an inconclusive canary, a rollback's next step), the
canary interval falling due, the leader check of highly available masters, or the periodic resync (a
safety net only: every Kubernetes input arrives through the watches). Pokes that land while a reconcile
runs are kept, so a change made during one causes exactly one more; bursts within `COALESCE_SECONDS`
cost one reconcile.

When kopf stops the worker (the resource was deleted, the operator exits) a reconcile in progress is
cancelled at once (`until_stopped`): kopf removes the finalizer only after the worker exited, and nothing
a reconcile does matters for a deleted resource.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from datetime import datetime
from typing import Any, Final, Protocol, TypeVar

from mooncake_operator import api
from mooncake_operator.metrics import ReconcileResult
from mooncake_operator.reconcile import proof
from mooncake_operator.reconcile.actions import Outcome
from mooncake_operator.reconcile.core import Runtime, reconcile

logger = logging.getLogger("mooncake_operator.reconcile")

COALESCE_SECONDS: Final = 0.05
T = TypeVar("T")


class StopFlag(Protocol):
    """What kopf passes a daemon as `stopped`: set when the resource is deleted or the operator exits."""

    def wait(self) -> Awaitable[object]: ...


async def until_stopped(work: Awaitable[T], stopped: StopFlag) -> T | None:
    """Awaits `work` unless `stopped` is set first, then cancels it (None).

    kopf removes the finalizer of a deleted resource only after its daemon exited and, when one does not
    exit at once, checks again only every `cancellation_polling` seconds: a reconcile busy in a canary
    would hold the deletion that long, though nothing it does matters for a deleted resource.
    """
    task = asyncio.ensure_future(work)
    stop = asyncio.ensure_future(stopped.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, stop):
            pending.cancel()  # a no-op for the one that finished
        await asyncio.gather(task, stop, return_exceptions=True)
    return None if task.cancelled() else task.result()


def interval_due_in(body: dict[str, Any] | None, now: datetime) -> float | None:
    """Seconds until `spec.canary.intervalSeconds` has elapsed since the last run finished (None: no
    interval, or it is already due, which the reconcile has just handled)."""
    if body is None:
        return None
    canary_spec = (body.get("spec") or {}).get("canary") or {}
    interval = canary_spec.get("intervalSeconds")
    finished = proof.parse_time((((body.get("status") or {}).get("canary")) or {}).get("finishedAt"))
    if interval is None or finished is None or canary_spec.get("enabled") is False:
        return None
    remaining = float(interval) - (now - finished).total_seconds()
    return remaining if remaining > 0 else None


def has_ha_masters(body: dict[str, Any] | None) -> bool:
    master = (((body or {}).get("spec") or {}).get("store") or {}).get("master") or {}
    return bool((master.get("highAvailability") or {}).get("enabled"))


def next_delay(runtime: Runtime, namespace: str, name: str, outcome: Outcome) -> float:
    """How long the worker may sleep without a poke."""
    delays = [runtime.settings.resync_seconds]
    if outcome.retry_after is not None:
        delays.append(outcome.retry_after)
    body = runtime.cache.get(api.API_VERSION, api.KIND, namespace, name)
    due = interval_due_in(body, runtime.clock())
    if due is not None:
        delays.append(due)
    if has_ha_masters(body):
        # Who leads is asked over HTTP (`reconcile.leader`), not watched, and a failover need not change
        # any pod. No API request: the reconcile reads the cache.
        delays.append(runtime.settings.leader_check_seconds)
    return max(min(delays), 0.0)


def log_outcome(namespace: str, name: str, outcome: Outcome, previous: Outcome | None) -> None:
    """An outcome that is not settled, once per change: waiting is INFO, invalid input and errors are
    warnings (API errors are logged where they happen, in `reconcile`)."""
    if outcome == previous or outcome.result in (ReconcileResult.READY, ReconcileResult.GONE):
        return
    level = logging.INFO if outcome.result is ReconcileResult.WAITING else logging.WARNING
    retry = f"; retrying in {outcome.retry_after:g} s" if outcome.retry_after is not None else ""
    logger.log(level, "%s/%s %s: %s%s", namespace, name, outcome.result.value, outcome.message, retry)


async def run_worker(runtime: Runtime, namespace: str, name: str, stopped: StopFlag) -> None:
    """Reconciles `namespace/name` until `stopped` (kopf stops the daemon on deletion and at exit)."""
    wake = runtime.wakes.register(namespace, name)
    stop = asyncio.ensure_future(stopped.wait())
    previous: Outcome | None = None
    try:
        while not stop.done():
            wake.clear()
            outcome = await until_stopped(reconcile(runtime, namespace, name), stopped)
            if outcome is None:
                break
            log_outcome(namespace, name, outcome, previous)
            previous = outcome
            woken = asyncio.ensure_future(wake.wait())
            await asyncio.wait(
                {woken, stop},
                timeout=next_delay(runtime, namespace, name, outcome),
                return_when=asyncio.FIRST_COMPLETED,
            )
            woken.cancel()
            if wake.is_set() and not stop.done():
                await asyncio.sleep(COALESCE_SECONDS)
    finally:
        stop.cancel()
        await asyncio.gather(stop, return_exceptions=True)
        runtime.wakes.unregister(namespace, name)
        runtime.forget(namespace, name)
