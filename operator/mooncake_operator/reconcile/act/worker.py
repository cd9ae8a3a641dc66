"""One worker per MooncakeServing: reconcile when something changed, or when a timer is due.

A worker reconciles its resource, then sleeps until the first of: a change to the resource or one of
its children or pods (the watch cache calls `Wakes.poke` with the owner), the delay its outcome asks for
(an API error, waiting for pods or a leading master, an inconclusive canary, a rollback's next step), the
canary interval falling due, the leader check of highly available masters (the decision carries these
timers: `Outcome.sleep_seconds`), or the periodic resync (a safety net only: every Kubernetes input
arrives through the watches). Pokes that land while a reconcile
runs are kept, so a change made during one causes exactly one more; bursts within `COALESCE_SECONDS`
cost one reconcile.

`Workers` starts a resource's worker when kopf's watch reports the resource, and cancels it, with a
reconcile in progress, once the resource is being deleted or the operator exits. The worker needs no
finalizer: it cleans nothing up (the children go by their owner references), so a resource deleted while
the operator is down is gone at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from mooncake_operator.reconcile.act.cache import WatchCache
from mooncake_operator.reconcile.act.core import Runtime, reconcile
from mooncake_operator.reconcile.decide.actions import Outcome, ReconcileResult

logger = logging.getLogger("mooncake_operator.reconcile")
# The first words of the line `Workers.close` logs once nothing reconciles any more.
WORKERS_STOPPED = "stopped all"

COALESCE_SECONDS: Final = 0.05
# After a reconcile raised a bug: kopf's delay before it restarted a daemon that raised, kept.
RESTART_SECONDS: Final = 60.0


def log_outcome(namespace: str, name: str, outcome: Outcome, previous: Outcome | None) -> None:
    """An outcome that is not settled, once per change: waiting is INFO, invalid input and errors are
    warnings (API errors are logged where they happen, in `reconcile`)."""
    if outcome == previous or outcome.result in (ReconcileResult.READY, ReconcileResult.GONE):
        return
    level = logging.INFO if outcome.result is ReconcileResult.WAITING else logging.WARNING
    retry = f"; retrying in {outcome.retry_after:g} s" if outcome.retry_after is not None else ""
    logger.log(level, "%s/%s %s: %s%s", namespace, name, outcome.result.value, outcome.message, retry)


async def run_worker(runtime: Runtime, namespace: str, name: str) -> None:
    """Reconciles `namespace/name` until cancelled (`Workers`: the resource was deleted, or the operator
    exits), which cancels a reconcile in progress at once: nothing it does matters any more."""
    wake = runtime.wakes.register(namespace, name)
    previous: Outcome | None = None
    try:
        while True:
            wake.clear()
            try:
                outcome = await reconcile(runtime, namespace, name)
            except Exception:
                # A bug, not the API server (whose errors are outcomes): logged, and tried again later.
                logger.exception(
                    "%s/%s: the reconcile failed; retrying in %g s", namespace, name, RESTART_SECONDS
                )
                await asyncio.sleep(RESTART_SECONDS)
                continue
            log_outcome(namespace, name, outcome, previous)
            previous = outcome
            # asyncio.wait, not wait_for: on Python 3.11 wait_for can swallow a cancellation that lands
            # as the wake-up does, and the worker would outlive its resource or the operator.
            woken = asyncio.ensure_future(wake.wait())
            try:
                await asyncio.wait({woken}, timeout=outcome.sleep_seconds(runtime.settings.resync_seconds))
            finally:
                woken.cancel()
            if wake.is_set():
                await asyncio.sleep(COALESCE_SECONDS)
    finally:
        runtime.wakes.unregister(namespace, name)
        runtime.forget(namespace, name)


@dataclass
class Workers:
    """One worker task per MooncakeServing that exists and is not being deleted, started and stopped by
    the events of kopf's watch (`observe`), which it also hands to the watch cache."""

    cache: WatchCache
    work: Callable[[str, str], Coroutine[Any, Any, None]]  # the worker of (namespace, name)
    tasks: dict[tuple[str, str], asyncio.Task[None]] = field(default_factory=dict)

    async def observe(self, event_type: str | None, obj: Mapping[str, Any]) -> None:
        """One event of kopf's watch (type None: listed). A worker is stopped once its resource is being
        deleted, and awaited, so that a resource created again under the name gets a fresh one."""
        self.cache.record(event_type, obj)
        metadata = obj.get("metadata") or {}
        key = (str(metadata.get("namespace") or ""), str(metadata.get("name") or ""))
        if event_type == "DELETED" or metadata.get("deletionTimestamp"):
            await self.stop(key)
        elif key not in self.tasks:
            self.tasks[key] = asyncio.create_task(self.work(*key), name=f"worker {key[0]}/{key[1]}")

    async def stop(self, key: tuple[str, str]) -> None:
        task = self.tasks.pop(key, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def close(self) -> None:
        """Stops every worker (the operator exits), then says so: the Lease is released only after this
        line, so a successor's acquireTime follows it (the fault tier checks that order)."""
        stopped = len(self.tasks)
        for key in list(self.tasks):
            await self.stop(key)
        logger.info("%s %d workers (their reconciles and canaries cancelled)", WORKERS_STOPPED, stopped)
