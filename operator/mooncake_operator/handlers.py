"""kopf handlers: decorators and one-line delegation to `mooncake_operator.reconcile`, nothing else.

Each MooncakeServing gets a kopf daemon running its worker (`reconcile.worker`): kopf starts it when the
resource appears (or the operator starts) and stops it on deletion and at exit. The worker reconciles
when the watch cache reports a change to the resource, its children or its pods, and on its timers.

`build_registry(settings)` registers the handlers on a fresh registry bound to one `RuntimeHolder`, so
an operator (or a test's `KopfRunner`) gets its own clients, created in its own event loop at startup and
closed at cleanup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import kopf

from mooncake_operator import api, reconcile
from mooncake_operator.operator_settings import OperatorSettings, configure_kopf, connection_info
from mooncake_operator.reconcile.worker import run_worker

RESOURCE = (api.GROUP, api.VERSION, api.PLURAL)


@dataclass
class RuntimeHolder:
    """The runtime of a running operator; absent before startup and after cleanup."""

    runtime: reconcile.Runtime | None = None

    def get(self) -> reconcile.Runtime:
        if self.runtime is None:
            raise kopf.TemporaryError("the operator is starting or stopping", delay=1)
        return self.runtime


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
    async def login(**_: Any) -> kopf.ConnectionInfo:
        return await connection_info(operator_settings.kube_config())

    # Level-based: the worker reconciles on every change the watches report (spec, annotations,
    # children, pods) and on its timers; no change handler, so kopf writes no diff-base annotations.
    # A worker stopped mid-reconcile cancels it (worker.until_stopped); kopf re-checks an exiting daemon
    # every TIMER_EXIT_POLL_SECONDS (settings.background.cancellation_polling) before removing the finalizer.
    @kopf.daemon(*RESOURCE, registry=registry)
    async def work(namespace: str | None, name: str, stopped: kopf.DaemonStopped, **_: Any) -> None:
        await run_worker(holder.get(), str(namespace), name, stopped)

    return registry
