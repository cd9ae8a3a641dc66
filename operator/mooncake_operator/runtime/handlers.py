"""kopf handlers: decorators and one-line delegation to `mooncake_operator.reconcile`, nothing else.

kopf watches MooncakeServings (the operator's only watch of the kind) and hands every event to
`reconcile.act.worker.Workers`, which keeps the watch cache's copy and runs one worker per resource: started
when the resource appears (or the operator starts), stopped once it is being deleted and at exit. The
worker reconciles when the watch cache reports a change to the resource, its children or its pods, and
on its timers. No handler needs a finalizer (nothing is cleaned up: the children go by their owner
references), so kopf adds none.

`build_registry(settings)` registers the handlers on a fresh registry bound to one `RuntimeHolder`, so
an operator (or a test's `KopfRunner`) gets its own clients, created in its own event loop at startup and
closed at cleanup.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import kopf

from mooncake_operator.api.group import GROUP, PLURAL, VERSION
from mooncake_operator.reconcile.act.core import Runtime
from mooncake_operator.reconcile.act.worker import Workers, run_worker
from mooncake_operator.runtime.settings import OperatorSettings, configure_kopf, connection_info

RESOURCE = (GROUP, VERSION, PLURAL)


@dataclass
class RuntimeHolder:
    """The runtime of a running operator; absent before startup and after cleanup."""

    runtime: Runtime | None = None
    workers: Workers | None = None

    def get(self) -> Runtime:
        if self.runtime is None:
            raise kopf.TemporaryError("the operator is starting or stopping", delay=1)
        return self.runtime

    def get_workers(self) -> Workers:
        if self.workers is None:
            raise kopf.TemporaryError("the operator is starting or stopping", delay=1)
        return self.workers


def build_registry(
    operator_settings: OperatorSettings, holder: RuntimeHolder | None = None
) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    holder = holder if holder is not None else RuntimeHolder()

    @kopf.on.startup(registry=registry)
    async def start(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_kopf(settings, operator_settings)
        runtime = holder.runtime = Runtime.start(operator_settings)
        holder.workers = Workers(runtime.cache, functools.partial(run_worker, runtime))

    @kopf.on.cleanup(registry=registry)
    async def stop(**_: Any) -> None:
        (runtime, holder.runtime), (workers, holder.workers) = (holder.runtime, None), (holder.workers, None)
        if workers is not None:
            await workers.close()
        if runtime is not None:
            await runtime.close()

    @kopf.on.login(registry=registry)
    async def login(**_: Any) -> kopf.ConnectionInfo:
        return await connection_info(operator_settings.kube_config())

    # Level-based: the workers reconcile on every change the watches report (spec, annotations,
    # children, pods) and on their timers; no change handler, so kopf writes no annotations.
    @kopf.on.event(*RESOURCE, registry=registry)
    async def watched(event: kopf.RawEvent, **_: Any) -> None:
        await holder.get_workers().observe(event.get("type"), event["object"])

    return registry
