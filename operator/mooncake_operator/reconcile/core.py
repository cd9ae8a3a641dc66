"""One reconcile of a MooncakeServing: validate -> render -> apply -> readiness -> canary -> status.

Level-based and kopf-free: each resource's worker (`reconcile.worker`) calls `reconcile`, which reads the
resource, its children and pods from the watch cache (`reconcile.cache`), has `plan` decide, applies and
writes what it decided, and returns an `Outcome` saying when to look again. Reconciles of one resource
are serialized by a per-resource lock; canaries across resources by `--max-concurrent-canaries`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import httpx
from pydantic import ValidationError

from mooncake_operator import api, canary_policy, render
from mooncake_operator.api import InvalidResourceError, MooncakeServing, MooncakeServingStatus
from mooncake_operator.canary import run_canary
from mooncake_operator.canary.models import CanaryResult, Verdict
from mooncake_operator.conditions import READY, find, merge_conditions
from mooncake_operator.crd import SERVING_KIND
from mooncake_operator.kube import KubeApiError, KubeClient, KubeError
from mooncake_operator.metrics import MetricsServer, OperatorMetrics, ReconcileResult, serve
from mooncake_operator.operator_settings import OperatorSettings
from mooncake_operator.reconcile import leader, plan, proof, status
from mooncake_operator.reconcile.cache import MANAGED_SELECTOR, PDB_KIND, Wakes, WatchCache, WatchedKind
from mooncake_operator.reconcile.children import (
    ApplyError,
    ImmutableChangeError,
    ensure_children,
    remove_replica_sets,
    scale_down_retired,
)
from mooncake_operator.reconcile.observe import Observation, observe, replica_sets
from mooncake_operator.reconcile.plan import Outcome
from mooncake_operator.reconcile.revisions import read_verified_last_good, write_last_good
from mooncake_operator.reconcile.slots import CanarySlots
from mooncake_operator.reconcile.traffic import set_traffic

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
    except InvalidResourceError as error:
        return await state.invalid(error.problems)
    refused = runtime.settings.refused_options(resource.spec)
    if refused:
        return await state.invalid(refused)
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

    async def write(self, standing: status.Standing, new: MooncakeServingStatus) -> None:
        """Patch what differs from the stored status; `standing` is what `new` was built from."""
        previous = self.current
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
                field_manager=api.FIELD_MANAGER,
                resource_version=self.resource_version,
            )
            self.resource_version = (written.get("metadata") or {}).get("resourceVersion")
        self.current, self.wire = new, new_wire
        ready = find(new.conditions, READY)
        self.runtime.metrics.record_status(self.namespace, self.name, new)
        if standing.phase != previous.phase or (
            standing.phase == "Invalid" and _ready_message(previous) != _ready_message(new)
        ):
            await self._event(standing, ready)

    async def _event(self, standing: status.Standing, ready: api.Condition | None) -> None:
        reason = ready.reason if ready else standing.phase
        message = f"{standing.phase}: {ready.message}" if ready else standing.phase
        logger.info("%s/%s %s", self.namespace, self.name, one_line(message))
        await self.runtime.kube.create_event(
            self.body, reason=reason, message=message, type=status.event_type(standing.phase, reason)
        )

    async def apply_failed(self, message: str, retry_after: float) -> Outcome:
        """The API server refused a child: Ready says why; every other field is kept."""
        standing = status.apply_failed(message, self.current.phase)
        conditions = merge_conditions(
            self.current.conditions,
            standing.conditions,
            now=proof.format_time(self.now),
            generation=self.generation,
        )
        update = {"phase": standing.phase, "observed_generation": self.generation, "conditions": conditions}
        await self.write(standing, self.current.model_copy(update=update))
        return Outcome(ReconcileResult.ERROR, message, retry_after=retry_after)

    async def invalid(self, problems: list[str]) -> Outcome:
        """Nothing is applied; the status says why, field by field (every other field is kept)."""
        standing = status.invalid(problems)
        conditions = merge_conditions(
            self.current.conditions,
            standing.conditions,
            now=proof.format_time(self.now),
            generation=self.generation,
        )
        update = {"phase": standing.phase, "observed_generation": self.generation, "conditions": conditions}
        await self.write(standing, self.current.model_copy(update=update))
        return Outcome(ReconcileResult.INVALID, "; ".join(problems))


def _ready_message(current: MooncakeServingStatus) -> str | None:
    ready = find(current.conditions, READY)
    return ready.message if ready else None


class _Pass:
    """One reconcile of a valid resource: reads, applies and writes what `plan` decides."""

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
        self.high_availability = state.current.high_availability
        self.timing = plan.Timing(
            retry_delay_seconds=self.settings.retry_delay_seconds,
            inconclusive_retry_seconds=self.settings.inconclusive_retry_seconds,
        )

    async def run(self) -> Outcome:
        last_good, refused = read_verified_last_good(
            self.runtime.cache, self.resource, self.state.current.last_good_revision
        )
        choice = plan.choose_revision(self.resource, self.state.current, last_good)
        serving = self.resource.model_copy(update={"spec": choice.spec})
        live = replica_sets(self.runtime.cache, self.resource)
        sets = plan.choose_sets(self.resource, self.state.current, live, render.replica_template_id(serving))
        policy = await self.runtime.policy_api_version()
        manifests = render.render_all(
            serving,
            owner_uid=self.uid,
            policy_api_version=policy,
            replica_set=sets.active,
            operator_namespace=self.settings.operator_namespace,
            open_http_by_default=self.settings.open_http_by_default,
        )
        try:
            applied = await ensure_children(self.kube, self.runtime.cache, manifests)
        except ImmutableChangeError as error:
            return await self.state.invalid(error.problems)
        except ApplyError as error:
            self.runtime.metrics.apply_failed(
                self.namespace, self.resource.metadata.name, error.kind, error.error.status
            )
            logger.warning("%s/%s: %s", self.namespace, self.resource.metadata.name, error)
            return await self.state.apply_failed(str(error), self.settings.retry_delay_seconds)
        written = [f"{child.kind}/{child.name} ({child.why})" for child in applied if child.why]
        if written:
            logger.info("%s/%s applied %s", self.namespace, self.resource.metadata.name, ", ".join(written))
            # Only a change of the rendered children can retire others (so no reads when idle).
            await scale_down_retired(
                self.kube, self.runtime.cache, self.namespace, render.retired_workloads(serving)
            )
        observation = await self.observe_leader(serving, observe(self.runtime.cache, serving, sets.active))
        inputs = plan.Inputs(
            resource=self.resource,
            current=self.state.current,
            choice=choice,
            observation=observation,
            last_good=last_good,
            now=self.state.now,
            timing=self.timing,
            high_availability=self.high_availability,
            last_good_refused=refused,
            sets=sets,
        )
        decision = plan.plan(inputs)
        await self.execute(decision)
        if decision.run_canary is not None:
            logger.info("%s/%s canary: %s", self.namespace, serving.metadata.name, decision.run_canary.why)
            fresh = await self.run_canary(serving, sets.active, decision.run_canary.target)
            logger.info(
                "%s/%s canary %s: %s",
                self.namespace,
                serving.metadata.name,
                fresh.canary.verdict,
                one_line(fresh.canary.reason),
            )
            now = self.runtime.clock()
            decision = plan.plan(replace(inputs, current=self.state.current, now=now, fresh=fresh))
            await self.execute(decision)
        assert decision.outcome is not None  # a plan that follows a run orders no other run
        return decision.outcome

    async def observe_leader(self, serving: MooncakeServing, observation: Observation) -> Observation:
        """Highly available masters: the leader from the masters' own view; an event on a failover."""
        urls = self.settings.master_endpoints_for(self.namespace, serving.metadata.name)
        found = await leader.observe_leader(self.runtime.http, serving, observation, urls)
        if found is None:
            self.high_availability = None
            return observation
        now = proof.format_time(self.state.now)
        self.high_availability, failover = leader.track(self.high_availability, found, now=now)
        if failover is not None:
            logger.info("%s/%s %s", self.namespace, serving.metadata.name, failover)
            await self.kube.create_event(
                self.state.body, reason="MasterFailover", message=failover, type="Warning"
            )
        return found.observation

    async def execute(self, decision: plan.Plan) -> None:
        """Record the last good revision, write the status, set the traffic labels, then delete the sets
        the plan retires: a status write that fails leaves every label and set as it was, and an old set
        goes only once its successor's pods are in the client Service."""
        if decision.record_last_good is not None:
            await write_last_good(self.kube, self.resource, decision.record_last_good, owner_uid=self.uid)
        await self.state.write(decision.standing, decision.status)
        await set_traffic(self.kube, self.namespace, decision.traffic_labels)
        if decision.remove_sets:
            logger.info(
                "%s/%s removing replica sets %s",
                self.namespace,
                self.resource.metadata.name,
                ", ".join(decision.remove_sets),
            )
            await remove_replica_sets(
                self.kube, self.runtime.cache, self.namespace, decision.remove_sets, self.uid
            )

    def replica_urls(self, serving: MooncakeServing, replica_set: str) -> list[str] | str:
        """The canary's URLs, or why there are none to use. Mapped URLs (an operator outside the
        cluster, tests) are looked up by the set's name, then by the resource's."""
        mapped = self.settings.endpoints_for(self.namespace, replica_set) or self.settings.endpoints_for(
            self.namespace, serving.metadata.name
        )
        if mapped is None:
            return render.replica_urls(serving, replica_set)
        if len(mapped) != serving.spec.replicas:
            return (
                f"the operator's replica endpoints list {len(mapped)} URLs for "
                f"{self.namespace}/{serving.metadata.name}, but spec.replicas is {serving.spec.replicas}"
            )
        return list(mapped)

    async def run_canary(
        self, serving: MooncakeServing, replica_set: str, target: api.CanaryTarget
    ) -> plan.CanaryRun:
        """Run it against the set's pods; returns the status evidence and the pods a failure blames."""
        pod_names = render.replica_pod_names(serving, replica_set)
        urls = self.replica_urls(serving, replica_set)
        if isinstance(urls, str):
            now = self.runtime.clock()
            return plan.CanaryRun(proof.not_run_status(urls, run_id="not-run", now=now, target=target))
        config, lowered = self.settings.limit_canary(canary_policy.canary_config(serving.spec, urls))
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
            now = self.runtime.clock()
            return plan.CanaryRun(proof.not_run_status(why, run_id="deadline", now=now, target=target))
        verdict = canary_policy.effective_verdict(
            result, require_external_hit=serving.spec.canary.require_external_hit
        )
        metrics = self.runtime.metrics
        metrics.canary_duration.observe(result.wall_s)
        metrics.canary_runs.labels(verdict=verdict.value).inc()
        canary = proof.canary_status(result, verdict=verdict, target=target, pod_names=pod_names)
        benign = proof.benign_divergence_message(result, pod_names)
        if benign is not None:
            # A pass over a divergence is never silent: the status holds it per pair, this says so.
            await self.kube.create_event(
                self.state.body, reason="CanaryBenignDivergence", message=benign, type="Normal"
            )
        blamed = proof.blamed_replicas(result, pod_names) if verdict is Verdict.FAILED else []
        return plan.CanaryRun(canary, tuple(blamed))
