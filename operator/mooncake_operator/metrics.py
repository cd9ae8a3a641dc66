"""The operator's own Prometheus metrics: reconciles, canary runs, readiness, API calls.

Each operator instance has its own registry (several operators may run in one test process); `serve`
exposes it on /metrics and returns a handle that stops the server.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from wsgiref.simple_server import WSGIServer

import prometheus_client
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

PREFIX = "mooncake_operator"
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class ReconcileResult(StrEnum):
    READY = "ready"
    WAITING = "waiting"
    CANARY_FAILED = "canary_failed"
    ROLLED_BACK = "rolled_back"
    INVALID = "invalid"
    GONE = "gone"
    ERROR = "error"


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
        for verdict in ("Passed", "Failed", "Inconclusive"):
            self.canary_runs.labels(verdict=verdict)
        self.canary_duration = prometheus_client.Histogram(
            f"{PREFIX}_canary_duration_seconds",
            "Duration of one canary run.",
            buckets=_DURATION_BUCKETS,
            registry=self.registry,
        )
        self.external_hit_tokens = prometheus_client.Gauge(
            f"{PREFIX}_canary_external_hit_tokens",
            "External prefix-cache hit tokens of the last canary run (sum over pairs).",
            ["namespace", "name"],
            registry=self.registry,
        )
        self.ready = prometheus_client.Gauge(
            f"{PREFIX}_ready", "1 when the resource is Ready.", ["namespace", "name"], registry=self.registry
        )

    def count_requests(self, read: Callable[[], Mapping[str, int]]) -> None:
        self.registry.register(_RequestCounts(read))

    def forget(self, namespace: str, name: str) -> None:
        """Drop the per-resource series of a deleted resource."""
        for gauge in (self.external_hit_tokens, self.ready):
            with contextlib.suppress(KeyError):  # never set for this resource
                gauge.remove(namespace, name)

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
