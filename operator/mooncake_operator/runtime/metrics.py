"""The operator's own Prometheus metrics: reconciles, canary verdicts, per-resource state, API calls.

Each operator instance has its own registry (several operators may run in one test process), with the
process and platform collectors registered on it too; `serve` exposes it on /metrics and returns a handle
that stops the server.

Per-resource series (`namespace`, `name`) are read at scrape time from what the operator last wrote to each
resource's status (`record_status`), so they always agree with `kubectl get`, survive an operator restart
(once the first reconcile reads the status) and vanish with the resource (`forget`). No label carries a run
id, a cache salt, a pod name or anything else unbounded.
"""

from __future__ import annotations

import contextlib
import platform
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import get_args
from wsgiref.simple_server import WSGIServer

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mooncake_operator import __version__
from mooncake_operator.api.spec import RolloutStrategy
from mooncake_operator.api.status import CanaryStatus, MooncakeServingStatus, Phase
from mooncake_operator.canary.models import Verdict
from mooncake_operator.reconcile.decide.actions import ReconcileResult

PREFIX = "mooncake_operator"
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class CanaryCause(StrEnum):
    """Why the last canary did not pass, as a bounded label value (`none` when it passed).

    Decided from the structured evidence in `status.canary` where there is some, else from the reason texts
    the canary itself writes (canary/runner.py); a text no rule knows is `other`, never a new label value.
    To add a cause: a member here and a rule in `CAUSE_RULES` (or in `canary_cause` for evidence).
    """

    NONE = "none"
    ANSWER_MISMATCH = "answer_mismatch"
    EXPECTATION_VIOLATED = "expectation_violated"
    REQUEST_FAILED = "request_failed"
    TIMEOUT = "timeout"
    REPLICA_UNREACHABLE = "replica_unreachable"
    METRICS_UNREADABLE = "metrics_unreadable"
    COUNTERS_RESET = "counters_reset"
    NO_EXTERNAL_HIT = "no_external_hit"
    HIT_SHORT = "hit_short"
    STORE_SAVE_FAILED = "store_save_failed"
    LOAD_FAILED = "load_failed"
    NOT_RUN = "not_run"
    OTHER = "other"


# (fragment of a reason text the canary writes, cause), first match wins; matched lower-cased.
CAUSE_RULES: tuple[tuple[str, CanaryCause], ...] = (
    ("kv load failure", CanaryCause.LOAD_FAILED),
    ("counters unavailable", CanaryCause.METRICS_UNREADABLE),
    ("no complete answer within", CanaryCause.TIMEOUT),
    ("counters went down", CanaryCause.COUNTERS_RESET),
    ("did not rise", CanaryCause.NO_EXTERNAL_HIT),
    ("did not cover the whole stored prefix", CanaryCause.HIT_SHORT),
    ("store rejected", CanaryCause.STORE_SAVE_FAILED),
    ("no store put", CanaryCause.STORE_SAVE_FAILED),
    ("cannot connect", CanaryCause.REPLICA_UNREACHABLE),
    ("request:", CanaryCause.REQUEST_FAILED),
    ("replica endpoints list", CanaryCause.NOT_RUN),
)

VERDICTS = tuple(verdict.value for verdict in Verdict)
PHASES: tuple[str, ...] = get_args(Phase)
STRATEGIES: tuple[str, ...] = get_args(RolloutStrategy)
CONDITION_STATUSES = ("True", "False", "Unknown")
REPLICA_STATES = ("desired", "ready", "serving", "held", "unproven")


class RolloutOutcome(StrEnum):
    PROMOTED = "promoted"  # a new revision serves users
    ROLLED_BACK = "rolled_back"  # a failed revision was undone (onFailure Rollback)
    HELD = "held"  # a failed BlueGreen candidate kept for inspection (onFailure Hold)


def canary_cause(canary: CanaryStatus) -> CanaryCause:
    if canary.verdict is Verdict.PASSED:
        return CanaryCause.NONE
    pairs = [pair for pair in canary.pairs if pair.verdict is canary.verdict] or canary.pairs
    if any(pair.answers_equal is False or pair.first_mismatch is not None for pair in pairs):
        return CanaryCause.ANSWER_MISMATCH
    if any(pair.violations for pair in pairs):
        return CanaryCause.EXPECTATION_VIOLATED
    texts = [pair.reason for pair in pairs] or [canary.reason]
    for text in texts:
        lowered = text.lower()
        for fragment, cause in CAUSE_RULES:
            if fragment in lowered:
                return cause
    return CanaryCause.OTHER


def _timestamp(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass
class _Resource:
    """What the metrics say about one MooncakeServing: its last written status, and counters."""

    status: MooncakeServingStatus | None = None
    last_passed: float | None = None  # finish time of the last passing run this process saw
    rollouts: Counter[tuple[str, str]] = field(default_factory=Counter)  # (strategy, outcome)
    apply_failures: Counter[tuple[str, str]] = field(default_factory=Counter)  # (kind, code)


def _rollout_outcomes(
    previous: MooncakeServingStatus | None, new: MooncakeServingStatus
) -> list[RolloutOutcome]:
    """The rollout steps between two statuses. None from the first status this process sees (it was
    written before: counting it again after a restart would double it)."""
    if previous is None:
        return []
    outcomes = []
    if (
        new.serving_revision
        and previous.serving_revision
        and new.serving_revision != previous.serving_revision
    ):
        outcomes.append(
            RolloutOutcome.ROLLED_BACK
            if new.failed_revision and new.failed_revision != previous.failed_revision
            else RolloutOutcome.PROMOTED
        )
    was_held = previous.rollout is not None and previous.rollout.candidate_phase == "Held"
    if new.rollout is not None and new.rollout.candidate_phase == "Held" and not was_held:
        outcomes.append(RolloutOutcome.HELD)
    return outcomes


def _replica_counts(status: MooncakeServingStatus) -> dict[str, int]:
    counts = {"desired": 0, "ready": 0, "serving": 0, "held": len(status.out_of_traffic), "unproven": 0}
    if status.replicas is not None:
        counts["desired"], counts["ready"] = status.replicas.desired, status.replicas.ready
    if status.traffic is not None:
        counts["serving"] = status.traffic.serving
        held = set(status.out_of_traffic)
        counts["unproven"] = sum(1 for pod in status.traffic.pods if not pod.serving and pod.name not in held)
    return counts


def _families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    keys = ["namespace", "name"]
    gauge, counter = GaugeMetricFamily, CounterMetricFamily
    return {
        "ready": gauge(f"{PREFIX}_ready", "1 when the resource is Ready.", labels=keys),
        "phase": gauge(
            f"{PREFIX}_phase", "1 for the resource's current phase (a state set).", labels=[*keys, "phase"]
        ),
        "condition": gauge(
            f"{PREFIX}_condition",
            "1 for each condition's current status (a state set per type).",
            labels=[*keys, "type", "status"],
        ),
        "replicas": gauge(
            f"{PREFIX}_replicas",
            "Replica pods by state: desired, ready, serving (in the client Service), held (out of traffic "
            "by a failed canary), unproven (not yet proven by a canary).",
            labels=[*keys, "state"],
        ),
        "verdict": gauge(
            f"{PREFIX}_canary_verdict",
            "1 for the last canary run's verdict (a state set).",
            labels=[*keys, "verdict"],
        ),
        "cause": gauge(
            f"{PREFIX}_canary_cause",
            "1 for why the last canary run did not pass (`none` when it passed; a state set).",
            labels=[*keys, "cause"],
        ),
        "finished": gauge(
            f"{PREFIX}_canary_finished_timestamp_seconds", "When the last canary run finished.", labels=keys
        ),
        "passed": gauge(
            f"{PREFIX}_canary_last_passed_timestamp_seconds",
            "When the last passing canary run finished (as this process saw it, or found it in status).",
            labels=keys,
        ),
        "hits": gauge(
            f"{PREFIX}_canary_external_hit_tokens",
            "External prefix-cache hit tokens of the last canary run (sum over pairs).",
            labels=keys,
        ),
        "expected": gauge(
            f"{PREFIX}_canary_expected_external_hit_tokens",
            "External hit tokens the last canary run demanded (sum over pairs; absent when any rise does).",
            labels=keys,
        ),
        "latency": gauge(
            f"{PREFIX}_canary_latency_seconds",
            "Slowest pair's cold (writer) and warm (reader) request latency of the last canary run.",
            labels=[*keys, "path"],
        ),
        "leader": gauge(
            f"{PREFIX}_master_leader_present",
            "Highly available masters: 1 while a master leads (Mooncake's own view).",
            labels=keys,
        ),
        "failovers": counter(
            f"{PREFIX}_master_failovers",
            "Highly available masters: leader changes observed (status.highAvailability.failovers).",
            labels=keys,
        ),
        "rollouts": counter(
            f"{PREFIX}_rollouts",
            "Rollout steps this operator process made, by strategy and outcome.",
            labels=[*keys, "strategy", "outcome"],
        ),
        "apply_failures": counter(
            f"{PREFIX}_apply_failures",
            "Children the API server refused to apply, by kind and HTTP status code.",
            labels=[*keys, "kind", "code"],
        ),
    }


class _ResourceCollector(Collector):
    def __init__(self, resources: Mapping[tuple[str, str], _Resource], lock: threading.Lock) -> None:
        self._resources, self._lock = resources, lock

    def collect(self) -> Iterator[Metric]:
        families = _families()
        with self._lock:
            items = sorted(self._resources.items())
            for (namespace, name), resource in items:
                _add_resource(families, [namespace, name], resource)
        yield from families.values()


def _add_resource(families: Mapping[str, Metric], keys: list[str], resource: _Resource) -> None:
    def add(family: str, labels: list[str], value: float) -> None:
        families[family].add_metric(keys + labels, value)  # type: ignore[attr-defined]

    for (strategy, outcome), count in sorted(resource.rollouts.items()):
        add("rollouts", [strategy, outcome], count)
    for (kind, code), count in sorted(resource.apply_failures.items()):
        add("apply_failures", [kind, code], count)
    if resource.last_passed is not None:
        add("passed", [], resource.last_passed)
    status = resource.status
    if status is None:
        return
    ready = next((c for c in status.conditions if c.type == "Ready"), None)
    add("ready", [], 1 if ready is not None and ready.status == "True" else 0)
    if status.phase is not None:
        for phase in PHASES:
            add("phase", [phase], 1 if phase == status.phase else 0)
    for condition in status.conditions:
        for value in CONDITION_STATUSES:
            add("condition", [condition.type, value], 1 if condition.status == value else 0)
    for state, count in _replica_counts(status).items():
        add("replicas", [state], count)
    if status.high_availability is not None:
        add("leader", [], 1 if status.high_availability.leader else 0)
        add("failovers", [], status.high_availability.failovers)
    canary = status.canary
    if canary is None:
        return
    for verdict in VERDICTS:
        add("verdict", [verdict], 1 if verdict == canary.verdict else 0)
    cause = canary_cause(canary)
    for member in CanaryCause:
        add("cause", [member.value], 1 if member is cause else 0)
    finished = _timestamp(canary.finished_at)
    if finished is not None:
        add("finished", [], finished)
    if canary.external_hit_tokens is not None:
        add("hits", [], canary.external_hit_tokens)
    expected = [pair.expected_external_hit_tokens for pair in canary.pairs]
    if expected and all(value is not None for value in expected):
        add("expected", [], sum(value for value in expected if value is not None))
    for path in ("cold", "warm"):
        values = [getattr(pair, f"{path}_latency_ms") for pair in canary.pairs]
        known = [value for value in values if value is not None]
        if known:
            add("latency", [path], max(known) / 1000)


class _RequestCounts(Collector):
    """`mooncake_operator_kube_requests_total{verb}` read from the API client's own counters."""

    def __init__(self, read: Callable[[], Mapping[str, int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            f"{PREFIX}_kube_requests",
            "API requests the operator made itself (kopf's watches excluded), by verb.",
            labels=["verb"],
        )
        for verb, count in sorted(self._read().items()):
            family.add_metric([verb], count)
        yield family


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        # The process's memory, CPU and file descriptors, and the Python version, as the default registry
        # would have them (a private registry starts empty).
        prometheus_client.ProcessCollector(registry=self.registry)
        prometheus_client.PlatformCollector(registry=self.registry)
        self.build_info = prometheus_client.Gauge(
            f"{PREFIX}_build_info",
            "Always 1; the operator's version and Python's.",
            ["version", "python_version"],
            registry=self.registry,
        )
        self.build_info.labels(version=__version__, python_version=platform.python_version()).set(1)
        self.leading = prometheus_client.Gauge(
            f"{PREFIX}_leading",
            "1 while this process reconciles (it holds the Lease, or runs without leader election); "
            "a standby serves no metrics.",
            registry=self.registry,
        )
        self.reconciles = prometheus_client.Counter(
            f"{PREFIX}_reconciles",
            "Reconciles by result.",
            ["result"],
            registry=self.registry,
        )
        for result in ReconcileResult:
            self.reconciles.labels(result=result.value)
        self.reconcile_duration = prometheus_client.Histogram(
            f"{PREFIX}_reconcile_duration_seconds",
            "Duration of one reconcile, canary included.",
            buckets=_DURATION_BUCKETS,
            registry=self.registry,
        )
        self.canary_runs = prometheus_client.Counter(
            f"{PREFIX}_canary_runs", "Canary runs by verdict.", ["verdict"], registry=self.registry
        )
        for verdict in VERDICTS:
            self.canary_runs.labels(verdict=verdict)
        self.canary_duration = prometheus_client.Histogram(
            f"{PREFIX}_canary_duration_seconds",
            "Duration of one canary run.",
            buckets=_DURATION_BUCKETS,
            registry=self.registry,
        )
        self.canaries = prometheus_client.Gauge(
            f"{PREFIX}_canaries",
            "Canary runs now running, and waiting for a slot (--max-concurrent-canaries).",
            ["state"],
            registry=self.registry,
        )
        for state in ("running", "waiting"):
            self.canaries.labels(state=state)
        self._lock = threading.Lock()  # scrapes run in the metrics server's thread
        self._resources: dict[tuple[str, str], _Resource] = {}
        self.registry.register(_ResourceCollector(self._resources, self._lock))

    def count_requests(self, read: Callable[[], Mapping[str, int]]) -> None:
        self.registry.register(_RequestCounts(read))

    def record_status(self, namespace: str, name: str, status: MooncakeServingStatus) -> None:
        """The status the operator just wrote (or found unchanged) for a resource."""
        with self._lock:
            resource = self._resources.setdefault((namespace, name), _Resource())
            strategy = status.rollout.strategy if status.rollout is not None else "InPlace"
            for outcome in _rollout_outcomes(resource.status, status):
                resource.rollouts[(strategy, outcome.value)] += 1
            canary = status.canary
            if canary is not None and canary.verdict is Verdict.PASSED:
                finished = _timestamp(canary.finished_at)
                if finished is not None and (resource.last_passed is None or finished > resource.last_passed):
                    resource.last_passed = finished
            resource.status = status

    def apply_failed(self, namespace: str, name: str, kind: str, code: int) -> None:
        with self._lock:
            resource = self._resources.setdefault((namespace, name), _Resource())
            resource.apply_failures[(kind, str(code))] += 1

    @contextlib.contextmanager
    def canary_queue(self) -> Iterator[Callable[[], None]]:
        """Count one canary as waiting for a slot until the yielded `started()` is called, then running."""
        waiting, running = self.canaries.labels(state="waiting"), self.canaries.labels(state="running")
        current = waiting
        current.inc()

        def started() -> None:
            nonlocal current
            current.dec()
            current = running
            current.inc()

        try:
            yield started
        finally:
            current.dec()

    def forget(self, namespace: str, name: str) -> None:
        """Drop the per-resource series of a deleted resource."""
        with self._lock:
            self._resources.pop((namespace, name), None)

    def exposition(self) -> str:
        return prometheus_client.generate_latest(self.registry).decode()


@dataclass
class MetricsServer:
    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve(metrics: OperatorMetrics, host: str, port: int) -> MetricsServer:
    server, thread = prometheus_client.start_http_server(port, addr=host, registry=metrics.registry)
    return MetricsServer(server, thread)
