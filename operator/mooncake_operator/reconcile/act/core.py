"""One reconcile of a MooncakeServing: read -> choose what to render -> apply -> observe -> decide -> act.

Level-based and kopf-free: each resource's worker (`act.worker`) calls `reconcile`, which reads the
resource, its last good record and live replica sets from the watch cache (`act.cache`), has
`decide.choose` choose what to render, applies it, observes the children (`act.snapshot`; and asks highly
available masters who leads, all at once: `act.master_health`), and hands that immutable snapshot to
`decide.plan.decide`. It carries out the actions decided, in their order; after a canary run,
`decide.plan.decide` runs again on the same snapshot with the run's result. It
returns an `Outcome` saying when to look again. Reconciles of one resource are serialized by a
per-resource lock; canaries across resources by `--max-concurrent-canaries`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
from pydantic import ValidationError

from mooncake_operator.api.base import describe_validation_error
from mooncake_operator.api.group import API_VERSION, FIELD_MANAGER, KIND
from mooncake_operator.api.resource import InvalidResourceError, MooncakeServing, parse_resource, plain
from mooncake_operator.api.status import CanaryTarget, MooncakeServingStatus
from mooncake_operator.build.disruption import POLICY_V1, POLICY_V1BETA1
from mooncake_operator.build.etcd import ha_enabled
from mooncake_operator.build.inference_pool import (
    INFERENCE_POOL_API_VERSION,
    INFERENCE_POOL_GROUP,
    INFERENCE_POOL_KIND,
)
from mooncake_operator.build.manifests import render_all
from mooncake_operator.build.master import retired_workloads
from mooncake_operator.build.names import master_pod_urls
from mooncake_operator.canary import policy
from mooncake_operator.canary.models import CanaryResult
from mooncake_operator.canary.runner import run_canary
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.kube.errors import KubeApiError, KubeError
from mooncake_operator.kube.kinds import SERVING_KIND
from mooncake_operator.reconcile.act.cache import MANAGED_SELECTOR, PDB_KIND, Wakes, WatchCache, WatchedKind
from mooncake_operator.reconcile.act.children import (
    ApplyError,
    ImmutableChangeError,
    ensure_children,
    remove_inference_pool,
    remove_replica_sets,
    scale_down_retired,
)
from mooncake_operator.reconcile.act.master_health import master_views
from mooncake_operator.reconcile.act.revisions import write_last_good
from mooncake_operator.reconcile.act.slots import CanarySlots
from mooncake_operator.reconcile.act.snapshot import observe, replica_sets
from mooncake_operator.reconcile.act.traffic import set_traffic
from mooncake_operator.reconcile.decide import actions, status
from mooncake_operator.reconcile.decide.actions import (
    Decision,
    Outcome,
    PostEvent,
    ReconcileResult,
    RunCanary,
)
from mooncake_operator.reconcile.decide.canary_run import CanaryRun, judge, not_run
from mooncake_operator.reconcile.decide.choose import Rendering, choose
from mooncake_operator.reconcile.decide.leadership import MasterView
from mooncake_operator.reconcile.decide.observe import Observation
from mooncake_operator.reconcile.decide.plan import (
    Snapshot,
    Timing,
    apply_failed,
    canary_urls,
    decide,
    invalid,
)
from mooncake_operator.reconcile.decide.revisions import config_map_name
from mooncake_operator.runtime.metrics import MetricsServer, OperatorMetrics, serve
from mooncake_operator.runtime.settings import OperatorSettings

logger = logging.getLogger("mooncake_operator.reconcile")

# A status write refused because the resource changed since it was read: re-read it and try again.
CONFLICT_ATTEMPTS = 3

_STATUS_FIELDS = frozenset(info.alias or name for name, info in MooncakeServingStatus.model_fields.items())


def utc_now() -> datetime:
    return datetime.now(UTC)


def one_line(text: str) -> str:
    """`text` for one log line: a replica's words (error details, model names) reach canary reasons and
    conditions, and a newline or a terminal escape in them must not start a forged operator log line."""
    return "".join(
        char if char.isprintable() or char == " " else char.encode("unicode_escape").decode("ascii")
        for char in text
    )


@dataclass
class Runtime:
    """What every reconcile shares: settings, the API client, the watch cache, the canary's HTTP client,
    metrics, and the workers' wake-up flags."""

    settings: OperatorSettings
    kube: KubeClient
    cache: WatchCache
    http: httpx.AsyncClient
    metrics: OperatorMetrics
    wakes: Wakes
    canary_slots: CanarySlots
    clock: Callable[[], datetime] = utc_now
    metrics_server: MetricsServer | None = None
    _locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    _policy_api_version: str | None = None
    inference_pools_watched: bool = False

    @classmethod
    def start(cls, settings: OperatorSettings, kube: KubeClient | None = None) -> Runtime:
        """Creates the clients (or takes `kube`) and starts the watches (in the running event loop)."""
        kube = kube or KubeClient(
            settings.kube_config(), timeout=settings.request_timeout_seconds, kinds=[SERVING_KIND]
        )
        wakes = Wakes()
        cache = WatchCache(
            kube,
            namespaces=settings.namespaces,
            on_change=wakes.poke,
            watch_timeout_seconds=settings.watch_timeout_seconds,
        )
        kube.on_write = cache.remember  # read-your-writes: the next reconcile sees what this one wrote
        cache.start()
        # trust_env=False: replica URLs are direct addresses; an environment proxy must not reroute them.
        http = httpx.AsyncClient(trust_env=False)
        metrics = OperatorMetrics()
        metrics.count_requests(lambda: dict(kube.counts.by_verb))
        metrics.leading.set(1)  # a standby waits for the Lease before it gets here
        runtime = cls(
            settings=settings,
            kube=kube,
            cache=cache,
            http=http,
            metrics=metrics,
            wakes=wakes,
            canary_slots=CanarySlots(
                settings.max_concurrent_canaries, settings.max_concurrent_canaries_per_namespace
            ),
        )
        if settings.metrics_port:
            runtime.metrics_server = serve(metrics, settings.metrics_host, settings.metrics_port)
        return runtime

    async def close(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.stop()
        await self.cache.close()
        await self.http.aclose()
        await self.kube.aclose()

    async def policy_api_version(self) -> str:
        """policy/v1 where served (Kubernetes >= 1.21), else policy/v1beta1; asked once per process."""
        if self._policy_api_version is None:
            served = await self.kube.served_versions("policy")
            version = POLICY_V1 if "v1" in served else POLICY_V1BETA1
            await self.cache.watch_kind(WatchedKind(version, PDB_KIND, MANAGED_SELECTOR))
            self._policy_api_version = version
        return self._policy_api_version

    async def watch_inference_pools(self) -> bool:
        """Whether the API server serves InferencePools (inference.networking.k8s.io/v1); once it does,
        they are watched like every child. Asked again on each pass until the CRD is installed."""
        if not self.inference_pools_watched:
            if "v1" not in await self.kube.served_versions(INFERENCE_POOL_GROUP):
                return False
            kind = WatchedKind(INFERENCE_POOL_API_VERSION, INFERENCE_POOL_KIND, MANAGED_SELECTOR)
            await self.cache.watch_kind(kind)
            self.inference_pools_watched = True
        return True

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    def forget(self, namespace: str, name: str) -> None:
        self._locks.pop((namespace, name), None)
        self.metrics.forget(namespace, name)


async def reconcile(runtime: Runtime, namespace: str, name: str) -> Outcome:
    """Reconcile one resource (serialized per resource); counts the outcome."""
    await runtime.cache.wait_synced()
    started = time.perf_counter()
    try:
        async with runtime.lock(namespace, name):
            outcome = await _reconcile_fresh_on_conflict(runtime, namespace, name)
    except KubeError as error:
        # The API server refused or did not answer: retried soon (kopf's default for errors is a minute).
        logger.warning("%s/%s: %s", namespace, name, error)
        outcome = Outcome(ReconcileResult.ERROR, str(error), retry_after=runtime.settings.retry_delay_seconds)
    except Exception:
        runtime.metrics.reconciles.labels(result=ReconcileResult.ERROR.value).inc()
        raise
    finally:
        runtime.metrics.reconcile_duration.observe(time.perf_counter() - started)
    runtime.metrics.reconciles.labels(result=outcome.result.value).inc()
    return outcome


async def _reconcile_fresh_on_conflict(runtime: Runtime, namespace: str, name: str) -> Outcome:
    """A status write carries the resourceVersion its decisions were made from; when the resource
    changed since (the cache was behind), the write is refused: read the resource and start over."""
    for attempt in range(1, CONFLICT_ATTEMPTS + 1):
        try:
            return await _reconcile(runtime, namespace, name)
        except KubeApiError as error:
            if not error.conflict or attempt == CONFLICT_ATTEMPTS:
                raise
            logger.info("%s/%s changed meanwhile (%s); reading it again", namespace, name, error.message)
            await _read_fresh(runtime, namespace, name)
    raise AssertionError("unreachable")


async def _read_fresh(runtime: Runtime, namespace: str, name: str) -> dict[str, Any] | None:
    """The resource from the API server, into the cache (only when the cache cannot answer)."""
    body = await runtime.kube.get_or_none(API_VERSION, KIND, name, namespace)
    if body is None:
        runtime.cache.forget(API_VERSION, KIND, namespace, name)
    else:
        runtime.cache.remember(body)
    return body


async def _reconcile(runtime: Runtime, namespace: str, name: str) -> Outcome:
    # From the watch cache, which also holds what this operator last wrote (read-your-writes).
    body = runtime.cache.get(API_VERSION, KIND, namespace, name)
    if body is None:  # not seen by the watch yet (just created), or gone
        body = await _read_fresh(runtime, namespace, name)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return Outcome(ReconcileResult.GONE, "the resource is gone or being deleted")
    actor = _Actor(runtime, body)
    stored = parse_status(actor.wire)
    now = runtime.clock()
    try:
        resource = parse_resource({**body, "status": None})
    except InvalidResourceError as error:
        return await actor.finish(invalid(stored, error.problems, generation=actor.generation, now=now))
    refused = runtime.settings.refused_options(resource.spec)
    if refused:
        return await actor.finish(invalid(stored, refused, generation=actor.generation, now=now))
    actor.resource = resource
    return await _Pass(runtime, actor, stored, now).run()


def owned_status(raw: Mapping[str, Any] | None) -> dict[str, Any]:
    """The status fields this operator writes (anything else there is not ours to patch away)."""
    return {key: value for key, value in (raw or {}).items() if key in _STATUS_FIELDS}


def parse_status(raw: Mapping[str, Any]) -> MooncakeServingStatus:
    try:
        return MooncakeServingStatus.model_validate(plain(raw))
    except ValidationError as error:
        logger.warning("ignoring an unreadable status: %s", "; ".join(describe_validation_error(error)))
        return MooncakeServingStatus()


class _Actor:
    """Carries out a decision's actions, in their order, on the resource as read (`body`). The status is
    patched against the stored one (only what differs), with the resourceVersion it was read at."""

    def __init__(self, runtime: Runtime, body: Mapping[str, Any]) -> None:
        self.runtime = runtime
        self.kube = runtime.kube
        self.body = body
        metadata = body.get("metadata") or {}
        self.namespace: str = metadata["namespace"]
        self.name: str = metadata["name"]
        self.generation: int | None = metadata.get("generation")
        self.resource_version: str | None = metadata.get("resourceVersion")
        self.wire = owned_status(body.get("status"))
        self.resource: MooncakeServing | None = None  # once it parsed

    async def carry_out(self, decision: Decision) -> None:
        """Every action but the canary run (the pass runs it: it comes last)."""
        for action in decision.actions:
            match action:
                case actions.PostEvent():
                    await self.post_event(action)
                case actions.RecordLastGood(spec=spec):
                    assert self.resource is not None  # only a valid resource's pass records one
                    await write_last_good(self.kube, self.resource, spec, owner_uid=self.owner_uid())
                case actions.WriteStatus(status=new):
                    await self.write_status(new)
                case actions.SetTraffic(labels=labels, uids=uids):
                    await set_traffic(self.kube, self.namespace, labels, uids)
                case actions.RemoveSets(names=names):
                    logger.info("%s/%s removing replica sets %s", self.namespace, self.name, ", ".join(names))
                    await remove_replica_sets(
                        self.kube, self.runtime.cache, self.namespace, names, self.owner_uid()
                    )
                case actions.RunCanary():
                    pass

    async def finish(self, decision: Decision) -> Outcome:
        """Carry out a decision that orders no canary run; its outcome."""
        await self.carry_out(decision)
        assert decision.outcome is not None  # set exactly when no run is ordered
        return decision.outcome

    def owner_uid(self) -> str:
        return str(self.body["metadata"]["uid"])

    async def write_status(self, new: MooncakeServingStatus) -> None:
        new_wire = status.without_empty_strings(new.to_wire())
        patch = status.merge_patch(self.wire, new_wire)
        if patch:
            # Computed against the status this reconcile read: refused (409) if the resource changed since.
            written = await self.kube.patch_status(
                API_VERSION,
                KIND,
                self.name,
                patch,
                self.namespace,
                field_manager=FIELD_MANAGER,
                resource_version=self.resource_version,
            )
            self.resource_version = (written.get("metadata") or {}).get("resourceVersion")
        self.wire = new_wire
        self.runtime.metrics.record_status(self.namespace, self.name, new)

    async def post_event(self, event: PostEvent) -> None:
        logger.info("%s/%s %s", self.namespace, self.name, one_line(event.message))
        await self.kube.create_event(self.body, reason=event.reason, message=event.message, type=event.type)


class _Pass:
    """One reconcile of a valid resource: read, choose what to render, apply it, observe, then carry out
    what the planner decides from that snapshot (and again after a canary run)."""

    def __init__(self, runtime: Runtime, actor: _Actor, stored: MooncakeServingStatus, now: datetime) -> None:
        assert actor.resource is not None  # a valid resource
        resource = actor.resource
        self.runtime = runtime
        self.settings = runtime.settings
        self.kube = runtime.kube
        self.actor = actor
        self.resource = resource
        self.stored = stored
        self.now = now
        self.namespace = resource.metadata.namespace
        self.timing = Timing(
            retry_delay_seconds=self.settings.retry_delay_seconds,
            inconclusive_retry_seconds=self.settings.inconclusive_retry_seconds,
            leader_check_seconds=self.settings.leader_check_seconds,
        )

    async def run(self) -> Outcome:
        cache = self.runtime.cache
        record = cache.get("v1", "ConfigMap", self.namespace, config_map_name(self.resource.metadata.name))
        rendering = choose(self.resource, self.stored, record, replica_sets(cache, self.resource))
        refused = await self.apply(rendering)
        if refused is not None:
            return await self.actor.finish(refused)
        # After the apply: what was just written (a new template: rollout not yet observed) is seen.
        serving = rendering.serving
        snapshot = Snapshot(
            resource=self.resource,
            status=self.stored,
            rendering=rendering,
            observation=observe(cache, serving, rendering.sets.active, rendering.rollout_view()),
            now=self.now,
            timing=self.timing,
            master_views=await self.ask_masters(serving),
        )
        decision = decide(snapshot)
        order = decision.canary
        if order is None:
            return await self.actor.finish(decision)
        await self.actor.carry_out(decision)
        pods = rendering.canary_pods()
        fresh = await self.run_canary(serving, rendering.sets.active, pods, order, snapshot.observation)
        return await self.actor.finish(decide(snapshot, fresh, now=self.runtime.clock()))

    async def apply(self, rendering: Rendering) -> Decision | None:
        """Apply the children (rendered from `rendering`); the decision to write when the API server
        refuses one or a change cannot be made, else None."""
        serving = rendering.serving
        manifests = render_all(
            serving,
            owner_uid=self.actor.owner_uid(),
            policy_api_version=await self.runtime.policy_api_version(),
            replica_set=rendering.sets.active,
            operator_namespace=self.settings.operator_namespace,
            open_http_by_default=self.settings.open_http_by_default,
            template=rendering.template,
            replicas=rendering.step.replicas if rendering.step is not None else None,
            partition=rendering.step.partition if rendering.step is not None else None,
        )
        generation = self.actor.generation
        if serving.spec.inference_pool is not None and not await self.runtime.watch_inference_pools():
            message = (
                "spec.inferencePool: the API server does not serve inference.networking.k8s.io/v1 "
                "InferencePools; install the Gateway API Inference Extension's CRDs, or unset "
                "spec.inferencePool"
            )
            return apply_failed(
                self.resource, self.stored, message, generation=generation, now=self.now, timing=self.timing
            )
        try:
            applied = await ensure_children(self.kube, self.runtime.cache, manifests)
        except ImmutableChangeError as error:
            return invalid(self.stored, error.problems, generation=generation, now=self.now)
        except ApplyError as error:
            name = self.resource.metadata.name
            self.runtime.metrics.apply_failed(self.namespace, name, error.kind, error.error.status)
            logger.warning("%s/%s: %s", self.namespace, name, error)
            message = str(error)
            return apply_failed(
                self.resource, self.stored, message, generation=generation, now=self.now, timing=self.timing
            )
        if serving.spec.inference_pool is None and self.runtime.inference_pools_watched:
            await remove_inference_pool(self.kube, self.runtime.cache, serving, self.actor.owner_uid())
        written = [f"{child.kind}/{child.name} ({child.why})" for child in applied if child.why]
        if written:
            logger.info("%s/%s applied %s", self.namespace, self.resource.metadata.name, ", ".join(written))
            # Only a change of the rendered children can retire others (so no reads when idle).
            await scale_down_retired(
                self.kube, self.runtime.cache, self.namespace, retired_workloads(serving)
            )
        return None

    async def ask_masters(self, serving: MooncakeServing) -> tuple[MasterView | None, ...] | None:
        """Highly available masters: each one's own view (`/health`), all asked at once; None otherwise.
        The master-endpoint override replaces the masters' addresses."""
        if not ha_enabled(serving):
            return None
        urls = self.settings.master_endpoints_for(self.namespace, serving.metadata.name)
        found = list(urls) if urls is not None else master_pod_urls(serving)
        return tuple(await master_views(self.runtime.http, found))

    def replica_urls(
        self, serving: MooncakeServing, replica_set: str, pod_names: list[str], observation: Observation
    ) -> list[str] | str:
        """The canary's URLs of `pod_names` (ordinal order), or why there are none to use: the IPs of the
        set's pods as observed (the pods this resource's StatefulSet created). Mapped URLs (an operator
        outside the cluster, tests) are looked up by the set's name, then by the resource's, and listed
        by ordinal (a rollout's surge pods follow spec.replicas' ordinals)."""
        mapped = self.settings.endpoints_for(self.namespace, replica_set) or self.settings.endpoints_for(
            self.namespace, serving.metadata.name
        )
        if mapped is None:
            return canary_urls(observation, pod_names, serving.spec.engine.port)
        ordinals = [int(name.rsplit("-", 1)[1]) for name in pod_names]
        if len(mapped) < serving.spec.replicas or any(ordinal >= len(mapped) for ordinal in ordinals):
            return (
                f"the operator's replica endpoints list {len(mapped)} URLs for "
                f"{self.namespace}/{serving.metadata.name}, but spec.replicas is {serving.spec.replicas}"
                + (f" and the canary proves ordinals up to {max(ordinals)}" if ordinals else "")
            )
        return [mapped[ordinal] for ordinal in ordinals]

    async def run_canary(
        self,
        serving: MooncakeServing,
        replica_set: str,
        pod_names: list[str],
        order: RunCanary,
        observation: Observation,
    ) -> CanaryRun:
        """Run it against `pod_names` of the set; returns the status evidence and the pods a failure
        blames."""
        logger.info("%s/%s canary: %s", self.namespace, serving.metadata.name, order.why)
        fresh = await self._run_canary(serving, replica_set, pod_names, order.target, observation)
        logger.info(
            "%s/%s canary %s: %s",
            self.namespace,
            serving.metadata.name,
            fresh.canary.verdict,
            one_line(fresh.canary.reason),
        )
        return fresh

    async def _run_canary(
        self,
        serving: MooncakeServing,
        replica_set: str,
        pod_names: list[str],
        target: CanaryTarget,
        observation: Observation,
    ) -> CanaryRun:
        urls = self.replica_urls(serving, replica_set, pod_names, observation)
        if isinstance(urls, str):
            return not_run(urls, run_id="not-run", now=self.runtime.clock(), target=target)
        config, lowered = self.settings.limit_canary(policy.canary_config(serving.spec, urls))
        for note in lowered:
            logger.warning("%s/%s canary: %s", self.namespace, serving.metadata.name, note)
        deadline = self.settings.canary_run_deadline_seconds
        with self.runtime.metrics.canary_queue() as started:

            async def run_in_slot() -> CanaryResult:
                started()
                return await run_canary(config, client=self.runtime.http)

            result = await self.runtime.canary_slots.run(self.namespace, deadline, run_in_slot)
        if result is None:
            why = (
                f"the canary run did not finish within the operator's {deadline:g} s deadline "
                "(--canary-run-deadline-seconds): replicas that accept and never answer?"
            )
            return not_run(why, run_id="deadline", now=self.runtime.clock(), target=target)
        fresh = judge(result, serving.spec, target=target, pod_names=pod_names)
        self.runtime.metrics.canary_duration.observe(result.wall_s)
        self.runtime.metrics.canary_runs.labels(verdict=fresh.canary.verdict.value).inc()
        return fresh
