"""One worker per MooncakeServing: reconcile when something changed, or when a timer is due.

A worker reconciles its resource, then sleeps until the first of: a change to the resource or one of
its children or pods (the watch cache calls `Wakes.poke` with the owner), the delay its outcome asks for
(an API error, an inconclusive canary, a rollback's next step), the canary interval falling due, or the
periodic resync (a safety net only: every input arrives through the watches). Pokes that land while a
reconcile runs are kept, so a change made during one causes exactly one more; bursts within
`COALESCE_SECONDS` cost one reconcile.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from datetime import datetime
from typing import Any, Final, Protocol

from mooncake_operator import api
from mooncake_operator.metrics import ReconcileResult
from mooncake_operator.reconcile import proof
from mooncake_operator.reconcile.core import Outcome, Runtime, reconcile

COALESCE_SECONDS: Final = 0.05


class Stopped(Protocol):
    """kopf's daemon `stopped` flag: true once the worker must exit; `wait()` resolves then."""

    def __bool__(self) -> bool: ...

    def wait(self) -> Awaitable[Any]: ...


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


def next_delay(runtime: Runtime, namespace: str, name: str, outcome: Outcome) -> float:
    """How long the worker may sleep without a poke."""
    delays = [runtime.settings.resync_seconds]
    # Waiting for readiness needs no timer: pods and workloads change through the watches.
    if outcome.retry_after is not None and outcome.result is not ReconcileResult.WAITING:
        delays.append(outcome.retry_after)
    body = runtime.cache.get(api.API_VERSION, api.KIND, namespace, name)
    due = interval_due_in(body, runtime.clock())
    if due is not None:
        delays.append(due)
    return max(min(delays), 0.0)


async def run_worker(runtime: Runtime, namespace: str, name: str, stopped: Stopped) -> None:
    """Reconciles `namespace/name` until `stopped` (kopf stops the daemon on deletion and at exit)."""
    wake = runtime.wakes.register(namespace, name)
    stop = asyncio.ensure_future(stopped.wait())
    try:
        while not stopped:
            wake.clear()
            outcome = await reconcile(runtime, namespace, name)
            woken = asyncio.ensure_future(wake.wait())
            await asyncio.wait(
                {woken, stop},
                timeout=next_delay(runtime, namespace, name, outcome),
                return_when=asyncio.FIRST_COMPLETED,
            )
            woken.cancel()
            if wake.is_set() and not stopped:
                await asyncio.sleep(COALESCE_SECONDS)
    finally:
        stop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stop
        runtime.wakes.unregister(namespace, name)
        runtime.forget(namespace, name)
