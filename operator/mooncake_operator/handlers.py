"""kopf handlers: decorators and one-line delegation to `mooncake_operator.reconcile`, nothing else.

`build_registry(settings)` registers the handlers on a fresh registry bound to one `RuntimeHolder`, so
an operator (or a test's `KopfRunner`) gets its own clients, created in its own event loop at startup and
closed at cleanup.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import kopf

from mooncake_operator import api, reconcile
from mooncake_operator.operator_settings import (
    WAITING_MARK,
    OperatorSettings,
    configure_kopf,
    connection_info,
)

RESOURCE = (api.GROUP, api.VERSION, api.PLURAL)
T = TypeVar("T")


class StopFlag(Protocol):
    """What kopf passes a timer as `stopped`: set when the resource is deleted or the operator exits."""

    def wait(self) -> Awaitable[object]: ...


async def until_stopped(work: Awaitable[T], stopped: StopFlag) -> T | None:
    """Awaits `work` unless `stopped` is set first, then cancels it (None).

    kopf removes the finalizer of a deleted resource only after its timers exited and, when one does
    not exit at once, checks again only every `cancellation_polling` seconds: a resync busy in a canary
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


@dataclass
class RuntimeHolder:
    """The runtime of a running operator; absent before startup and after cleanup."""

    runtime: reconcile.Runtime | None = None

    def get(self) -> reconcile.Runtime:
        if self.runtime is None:
            raise kopf.TemporaryError("the operator is starting or stopping", delay=1)
        return self.runtime


def raise_for(outcome: reconcile.Outcome) -> None:
    """kopf's retry semantics of an outcome: invalid input never gets better; waiting is retried."""
    if outcome.result is reconcile.ReconcileResult.INVALID:
        raise kopf.PermanentError(outcome.message)
    if outcome.retry_after is None:
        return
    if outcome.result is reconcile.ReconcileResult.ERROR:
        raise kopf.TemporaryError(outcome.message, delay=outcome.retry_after)
    # Not ready yet (pods, a rollback, an inconclusive canary): logged at INFO, see WaitingLogFilter.
    raise kopf.TemporaryError(
        f"{WAITING_MARK}retrying in {outcome.retry_after:g} s: {outcome.message}", delay=outcome.retry_after
    )


def build_registry(
    operator_settings: OperatorSettings, holder: RuntimeHolder | None = None
) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    holder = holder if holder is not None else RuntimeHolder()

    @kopf.on.startup(registry=registry)
    async def start(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_kopf(settings, operator_settings)
        holder.runtime = reconcile.Runtime.start(operator_settings)

    @kopf.on.cleanup(registry=registry)
    async def stop(**_: Any) -> None:
        runtime, holder.runtime = holder.runtime, None
        if runtime is not None:
            await runtime.close()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(operator_settings.kube_config())

    @kopf.on.create(*RESOURCE, registry=registry)
    async def created(namespace: str | None, name: str, **_: Any) -> None:
        raise_for(await reconcile.reconcile(holder.get(), str(namespace), name))

    @kopf.on.update(*RESOURCE, registry=registry)
    async def updated(namespace: str | None, name: str, **_: Any) -> None:
        raise_for(await reconcile.reconcile(holder.get(), str(namespace), name))

    @kopf.on.resume(*RESOURCE, registry=registry)
    async def resumed(namespace: str | None, name: str, **_: Any) -> None:
        raise_for(await reconcile.reconcile(holder.get(), str(namespace), name))

    # Level-based: readiness, replaced pods, master restarts and the canary interval change nothing in
    # the resource, so nothing else would notice them. The outcome is not raised: the next tick retries.
    @kopf.timer(
        *RESOURCE,
        interval=operator_settings.resync_seconds,
        initial_delay=operator_settings.resync_seconds,
        registry=registry,
    )
    async def resync(namespace: str | None, name: str, **kwargs: Any) -> None:
        stopped: kopf.DaemonStopped = kwargs["stopped"]
        await until_stopped(reconcile.reconcile(holder.get(), str(namespace), name), stopped)

    @kopf.on.delete(*RESOURCE, optional=True, registry=registry)
    async def deleted(namespace: str | None, name: str, **_: Any) -> None:
        holder.get().forget(str(namespace), name)

    return registry
