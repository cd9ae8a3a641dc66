"""One reconcile of a MooncakeServing: validate -> render -> apply -> readiness -> canary -> status.

Level-based and kopf-free: each resource's worker (`reconcile.worker`) calls `reconcile`, which reads the
resource, its children and pods from the watch cache (`reconcile.cache`), does what the present state
asks, and returns an `Outcome` saying when to look again. Reconciles of one resource are serialized by a
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

from mooncake_operator import api, render
from mooncake_operator.api import (
    CanaryStatus,
    InvalidResourceError,
    MooncakeServing,
    MooncakeServingSpec,
    MooncakeServingStatus,
    ReplicaCounts,
)
from mooncake_operator.canary import run_canary
from mooncake_operator.canary.models import Verdict
from mooncake_operator.conditions import READY, find, merge_conditions
from mooncake_operator.kube import KubeApiError, KubeClient, KubeError
from mooncake_operator.metrics import MetricsServer, OperatorMetrics, ReconcileResult, serve
from mooncake_operator.operator_settings import FIELD_MANAGER, RERUN_CANARY_ANNOTATION, OperatorSettings
from mooncake_operator.reconcile import proof, status
from mooncake_operator.reconcile.cache import (
    MANAGED_SELECTOR,
    PDB_KIND,
    Wakes,
    WatchCache,
    WatchedKind,
)
from mooncake_operator.reconcile.children import ImmutableChangeError, ensure_children
from mooncake_operator.reconcile.observe import Observation, observe
from mooncake_operator.reconcile.revisions import read_last_good, record_last_good
from mooncake_operator.reconcile.traffic import sync_traffic

logger = logging.getLogger("mooncake_operator.reconcile")

# A status write refused because the resource changed since it was read: re-read it and try again.
CONFLICT_ATTEMPTS = 3

_STATUS_FIELDS = frozenset(info.alias or name for name, info in MooncakeServingStatus.model_fields.items())


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class Outcome:
    result: ReconcileResult
    message: str = ""
    # Set when the change handler should try again (kopf.TemporaryError); None: done until the next change.
    retry_after: float | None = None


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
    canary_slots: asyncio.Semaphore
    clock: Callable[[], datetime] = utc_now
    metrics_server: MetricsServer | None = None
    _locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    _policy_api_version: str | None = None

    @classmethod
    def start(cls, settings: OperatorSettings, kube: KubeClient | None = None) -> Runtime:
        """Creates the clients (or takes `kube`) and starts the watches (in the running event loop)."""
        kube = kube or KubeClient(settings.kube_config(), timeout=settings.request_timeout_seconds)
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
        runtime = cls(
            settings=settings,
            kube=kube,
            cache=cache,
            http=http,
            metrics=metrics,
            wakes=wakes,
            canary_slots=asyncio.Semaphore(settings.max_concurrent_canaries),
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
            version = render.POLICY_V1 if "v1" in served else render.POLICY_V1BETA1
            await self.cache.watch_kind(WatchedKind(version, PDB_KIND, MANAGED_SELECTOR))
            self._policy_api_version = version
        return self._policy_api_version

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
    body = await runtime.kube.get_or_none(api.API_VERSION, api.KIND, name, namespace)
    if body is None:
        runtime.cache.forget(api.API_VERSION, api.KIND, namespace, name)
    else:
        runtime.cache.remember(body)
    return body


async def _reconcile(runtime: Runtime, namespace: str, name: str) -> Outcome:
    # From the watch cache, which also holds what this operator last wrote (read-your-writes).
    body = runtime.cache.get(api.API_VERSION, api.KIND, namespace, name)
    if body is None:  # not seen by the watch yet (just created), or gone
        body = await _read_fresh(runtime, namespace, name)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return Outcome(ReconcileResult.GONE, "the resource is gone or being deleted")
    state = _StatusWriter(runtime, body)
    try:
        resource = api.parse_resource({**body, "status": None})
        proof.validate_canary_spec(resource.spec)
    except InvalidResourceError as error:
        return await state.invalid(error.problems)
    return await _Pass(runtime, body, resource, state).run()


def owned_status(raw: Mapping[str, Any] | None) -> dict[str, Any]:
    """The status fields this operator writes (anything else there is not ours to patch away)."""
    return {key: value for key, value in (raw or {}).items() if key in _STATUS_FIELDS}


def parse_status(raw: Mapping[str, Any]) -> MooncakeServingStatus:
    try:
        return MooncakeServingStatus.model_validate(api.plain(raw))
    except ValidationError as error:
        logger.warning("ignoring an unreadable status: %s", "; ".join(api.describe_validation_error(error)))
        return MooncakeServingStatus()


class _StatusWriter:
    """Writes status only when it changed, and posts an event on every phase transition."""

    def __init__(self, runtime: Runtime, body: Mapping[str, Any]) -> None:
        self.runtime = runtime
        self.body = body
        metadata = body.get("metadata") or {}
        self.namespace: str = metadata["namespace"]
        self.name: str = metadata["name"]
        self.generation: int | None = metadata.get("generation")
        self.resource_version: str | None = metadata.get("resourceVersion")
        self.wire = owned_status(body.get("status"))
        self.current = parse_status(self.wire)
        self.now = runtime.clock()

    async def write(self, verdict: status.Verdict, **fields: Any) -> None:
        previous = self.current
        conditions = merge_conditions(
            previous.conditions,
            verdict.conditions,
            now=proof.format_time(self.now),
            generation=self.generation,
        )
        new = MooncakeServingStatus(
            phase=verdict.phase,
            observed_generation=self.generation,
            conditions=conditions,
            **fields,
        )
        new_wire = status.without_empty_strings(new.to_wire())
        patch = status.merge_patch(self.wire, new_wire)
        if patch:
            # Computed against the status this reconcile read: refused (409) if the resource changed since.
            written = await self.runtime.kube.patch_status(
                api.API_VERSION,
                api.KIND,
                self.name,
                patch,
                self.namespace,
                field_manager=FIELD_MANAGER,
                resource_version=self.resource_version,
            )
            self.resource_version = (written.get("metadata") or {}).get("resourceVersion")
        self.current, self.wire = new, new_wire
        ready = find(conditions, READY)
        self.runtime.metrics.ready.labels(self.namespace, self.name).set(
            1 if ready and ready.status == "True" else 0
        )
        if verdict.phase != previous.phase or (
            verdict.phase == "Invalid" and _ready_message(previous) != _ready_message(new)
        ):
            await self._event(verdict, ready)

    async def _event(self, verdict: status.Verdict, ready: api.Condition | None) -> None:
        reason = ready.reason if ready else verdict.phase
        message = f"{verdict.phase}: {ready.message}" if ready else verdict.phase
        logger.info("%s/%s %s", self.namespace, self.name, message)
        await self.runtime.kube.create_event(
            self.body, reason=reason, message=message, type=status.event_type(verdict.phase, reason)
        )

    def keep(self) -> dict[str, Any]:
        """Every field of the current status except phase, observedGeneration and conditions."""
        return {
            "replicas": self.current.replicas,
            "canary": self.current.canary,
            "last_good_revision": self.current.last_good_revision,
            "desired_revision": self.current.desired_revision,
            "serving_revision": self.current.serving_revision,
            "failed_revision": self.current.failed_revision,
            "out_of_traffic": list(self.current.out_of_traffic),
        }

    async def invalid(self, problems: list[str]) -> Outcome:
        """Nothing is applied; the status says why, field by field."""
        verdict = status.invalid(problems)
        await self.write(verdict, **self.keep())
        return Outcome(ReconcileResult.INVALID, "; ".join(problems))


def _ready_message(current: MooncakeServingStatus) -> str | None:
    ready = find(current.conditions, READY)
    return ready.message if ready else None


class _Pass:
    """One reconcile of a valid resource."""

    def __init__(
        self, runtime: Runtime, body: Mapping[str, Any], resource: MooncakeServing, state: _StatusWriter
    ) -> None:
        self.runtime = runtime
        self.settings = runtime.settings
        self.kube = runtime.kube
        self.resource = resource
        self.state = state
        self.uid: str = body["metadata"]["uid"]
        self.namespace = resource.metadata.namespace
        self.rerun = resource.metadata.annotations.get(RERUN_CANARY_ANNOTATION)

    @property
    def rerun_requested(self) -> bool:
        last = self.state.current.canary
        return self.rerun is not None and (
            last is None or last.target is None or last.target.rerun != self.rerun
        )

    async def choose_revision(self) -> tuple[status.Revisions, MooncakeServingSpec]:
        """The spec's revision, or the last good one while the spec's revision stands rolled back."""
        spec = self.resource.spec
        desired = render.spec_hash(spec)
        current = self.state.current
        failed = current.failed_revision
        if failed is not None and (
            failed != desired or self.rerun_requested or spec.canary.on_failure != "Rollback"
        ):
            failed = None  # a new spec, a retry, or Rollback turned off: roll the spec out
        serving_spec, serving = spec, desired
        if failed is not None:
            stored = read_last_good(self.runtime.cache, self.resource)
            if stored is not None and stored.revision != desired:
                serving_spec, serving = stored.spec, stored.revision
            else:
                failed = None
        return status.Revisions(desired, serving, failed, current.last_good_revision), serving_spec

    def fields(self, revisions: status.Revisions, observation: Observation, **changes: Any) -> dict[str, Any]:
        values = {
            **self.state.keep(),
            "replicas": ReplicaCounts(desired=observation.replicas.desired, ready=observation.replicas.ready),
            "desired_revision": revisions.desired,
            "serving_revision": revisions.serving,
            "failed_revision": revisions.failed,
            "last_good_revision": revisions.last_good,
        }
        return {**values, **changes}

    async def run(self) -> Outcome:
        revisions, serving_spec = await self.choose_revision()
        serving = self.resource.model_copy(update={"spec": serving_spec})
        policy = await self.runtime.policy_api_version()
        manifests = render.render_all(serving, owner_uid=self.uid, policy_api_version=policy)
        try:
            applied = await ensure_children(self.kube, self.runtime.cache, manifests)
        except ImmutableChangeError as error:
            return await self.state.invalid(error.problems)
        written = [f"{child.kind}/{child.name} ({child.why})" for child in applied if child.why]
        if written:
            logger.info("%s/%s applied %s", self.namespace, self.resource.metadata.name, ", ".join(written))
        observation = observe(self.runtime.cache, serving)
        held = list(self.state.current.out_of_traffic)
        await sync_traffic(self.kube, self.namespace, observation.replicas.pods, held)
        enabled = self.resource.spec.canary.enabled
        last = self.state.current.canary
        if not observation.ready:
            verdict = status.not_ready(observation, revisions, last, enabled=enabled)
            await self.state.write(verdict, **self.fields(revisions, observation))
            return Outcome(
                ReconcileResult.WAITING,
                verdict.conditions[READY].message,
                retry_after=self.settings.retry_delay_seconds,
            )
        if not enabled:
            verdict = self.settled(observation, revisions, last)
            await self.state.write(verdict, **self.fields(revisions, observation))
            return Outcome(ReconcileResult.READY, verdict.conditions[READY].message)
        target = self.target(serving, revisions, observation)
        why = proof.canary_due(
            last,
            target,
            now=self.state.now,
            interval_seconds=self.resource.spec.canary.interval_seconds,
            inconclusive_retry_seconds=self.settings.inconclusive_retry_seconds,
        )
        if why is None:
            verdict = self.settled(observation, revisions, last)
            await self.state.write(verdict, **self.fields(revisions, observation))
            return self.outcome(verdict, last, revisions)
        return await self.prove(serving, revisions, observation, target, why)

    def settled(
        self, observation: Observation, revisions: status.Revisions, canary: CanaryStatus | None
    ) -> status.Verdict:
        return status.settled(
            observation,
            revisions,
            canary,
            enabled=self.resource.spec.canary.enabled,
            on_failure=self.resource.spec.canary.on_failure,
        )

    def outcome(
        self, verdict: status.Verdict, canary: CanaryStatus | None, revisions: status.Revisions
    ) -> Outcome:
        message = verdict.conditions[READY].message
        if verdict.phase == "Ready":
            return Outcome(ReconcileResult.READY, message)
        if revisions.rolled_back:
            return Outcome(ReconcileResult.ROLLED_BACK, message)
        if canary is not None and canary.verdict == "Inconclusive":
            return Outcome(
                ReconcileResult.CANARY_FAILED, message, retry_after=self.settings.inconclusive_retry_seconds
            )
        return Outcome(ReconcileResult.CANARY_FAILED, message)

    def target(
        self, serving: MooncakeServing, revisions: status.Revisions, observation: Observation
    ) -> api.CanaryTarget:
        by_name = {pod.name: pod for pod in observation.replicas.pods}
        master = observation.master.pod
        return proof.current_target(
            revision=revisions.serving,
            generation=self.resource.metadata.generation,
            replica_pods=[by_name[name].identity for name in render.replica_pod_names(serving)],
            master_pod=master.uid if master else None,
            master_restarts=master.restarts if master else 0,
            rerun=self.rerun,
        )

    def replica_urls(self, serving: MooncakeServing) -> list[str] | str:
        """The canary's URLs, or why there are none to use."""
        mapped = self.settings.endpoints_for(self.namespace, serving.metadata.name)
        if mapped is None:
            return render.replica_urls(serving)
        if len(mapped) != serving.spec.replicas:
            return (
                f"the operator's replica endpoints list {len(mapped)} URLs for "
                f"{self.namespace}/{serving.metadata.name}, but spec.replicas is {serving.spec.replicas}"
            )
        return list(mapped)

    async def run_canary(
        self, serving: MooncakeServing, target: api.CanaryTarget
    ) -> tuple[Verdict, CanaryStatus, list[str]]:
        """Run it; returns the verdict, the status evidence, and the pods a failure blames."""
        pod_names = render.replica_pod_names(serving)
        urls = self.replica_urls(serving)
        if isinstance(urls, str):
            now = self.runtime.clock()
            return (
                Verdict.INCONCLUSIVE,
                proof.not_run_status(urls, run_id="not-run", now=now, target=target),
                [],
            )
        async with self.runtime.canary_slots:
            result = await run_canary(proof.canary_config(serving.spec, urls), client=self.runtime.http)
        verdict = proof.effective_verdict(
            result, require_external_hit=serving.spec.canary.require_external_hit
        )
        metrics = self.runtime.metrics
        metrics.canary_duration.observe(result.wall_s)
        metrics.canary_runs.labels(verdict=verdict.value).inc()
        canary = proof.canary_status(result, verdict=verdict, target=target, pod_names=pod_names)
        if canary.external_hit_tokens is not None:
            metrics.external_hit_tokens.labels(self.namespace, serving.metadata.name).set(
                canary.external_hit_tokens
            )
        blamed = proof.blamed_replicas(result, pod_names) if verdict is Verdict.FAILED else []
        return verdict, canary, blamed

    async def prove(
        self,
        serving: MooncakeServing,
        revisions: status.Revisions,
        observation: Observation,
        target: api.CanaryTarget,
        why: str,
    ) -> Outcome:
        await self.state.write(
            status.canary_running(observation, revisions, why), **self.fields(revisions, observation)
        )
        logger.info("%s/%s canary: %s", self.namespace, serving.metadata.name, why)
        verdict, canary, blamed = await self.run_canary(serving, target)
        logger.info(
            "%s/%s canary %s: %s", self.namespace, serving.metadata.name, verdict.value, canary.reason
        )
        if verdict is Verdict.PASSED:
            if not revisions.rolled_back:
                await record_last_good(
                    self.kube, self.runtime.cache, self.resource, serving.spec, owner_uid=self.uid
                )
            revisions = status.Revisions(
                revisions.desired, revisions.serving, revisions.failed, revisions.serving
            )
            held: list[str] = []
        else:
            held = sorted(set(self.state.current.out_of_traffic) | set(blamed))
        await sync_traffic(self.kube, self.namespace, observation.replicas.pods, held)
        if verdict is Verdict.FAILED and await self.can_roll_back(revisions):
            return await self.roll_back(observation, revisions, canary, held)
        fields = self.fields(revisions, observation, canary=canary, out_of_traffic=held)
        settled = self.settled(observation, revisions, canary)
        await self.state.write(settled, **fields)
        return self.outcome(settled, canary, revisions)

    async def can_roll_back(self, revisions: status.Revisions) -> bool:
        """Rollback applies to the spec's own revision, when a different last good revision is stored."""
        if self.resource.spec.canary.on_failure != "Rollback" or revisions.serving != revisions.desired:
            return False
        stored = read_last_good(self.runtime.cache, self.resource)
        return stored is not None and stored.revision != revisions.desired

    async def roll_back(
        self,
        observation: Observation,
        revisions: status.Revisions,
        canary: CanaryStatus,
        held: list[str],
    ) -> Outcome:
        """Record the failed revision; the next pass renders the last good one (the spec is untouched)."""
        verdict = status.rolling_back(observation, revisions, canary)
        fields = self.fields(revisions, observation, canary=canary, out_of_traffic=held)
        await self.state.write(verdict, **{**fields, "failed_revision": revisions.desired})
        return Outcome(
            ReconcileResult.ROLLED_BACK,
            verdict.conditions[READY].message,
            retry_after=min(self.settings.retry_delay_seconds, 1.0),
        )
