"""A real Prometheus (Debian's 2.42, on 127.0.0.1) scrapes a real operator of a cluster test: the chart's
scrape setting, the operator's per-resource series, the alert rules and every dashboard query.

The operator runs against the real API server with two loopback fake vLLM replicas, one corrupting answers
computed from a loaded prefix: the canary fails. Prometheus scrapes the operator with the chart's
ServiceMonitor `honorLabels` and a target label `namespace` (what the Prometheus Operator attaches), and
the fake replicas' /metrics with the labels the chart's engine PodMonitor adds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from tests.cluster.operator_harness import (
    FakeKubelet,
    run_operator,
    serving,
    wait_for_phase,
)
from tests.support.chart import SERVICE_MONITOR_API, only, render
from tests.support.fake_vllm import FakeCluster, Mode
from tests.support.prometheus import PrometheusServer, free_port, promtool, running_prometheus

from mooncake_operator.kube.client import KubeClient
from mooncake_operator.runtime.settings import OperatorSettings

REPO_ROOT = Path(__file__).resolve().parents[2]
RULES = REPO_ROOT / "charts" / "mooncake-operator" / "files" / "prometheus-rules.yaml"
DASHBOARD = REPO_ROOT / "charts" / "mooncake-operator" / "dashboards" / "mooncake-operator.json"
OPERATOR_NAMESPACE = "mooncake-system"  # the operator Service's namespace, as a target label
# Panels that have nothing to show in this scenario: no highly available masters, no rollout step, no
# refused child, and no canary that ever passed.
EMPTY_HERE = {
    "Leader present (highly available masters)",
    "Failovers",
    "Rollout steps",
    "Apply failures",
    "Since the last pass",
}


def chart_honor_labels(tmp_path: Path) -> bool:
    values = {"metrics": {"serviceMonitor": {"enabled": True}}}
    monitor = only(render(values, tmp_path, api_versions=(SERVICE_MONITOR_API,)), "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    return bool(endpoint.get("honorLabels", False))


def scrape_configs(
    operator_port: int, namespace: str, replicas: list[str], honor_labels: bool
) -> list[dict[str, Any]]:
    return [
        {
            "job_name": "mooncake-operator",
            "honor_labels": honor_labels,
            "static_configs": [
                {"targets": [f"127.0.0.1:{operator_port}"], "labels": {"namespace": OPERATOR_NAMESPACE}}
            ],
        },
        {
            "job_name": "vllm",
            "static_configs": [
                {
                    "targets": [urlsplit(url).netloc for url in replicas],
                    "labels": {"namespace": namespace, "mooncake_serving": "demo"},
                }
            ],
        },
    ]


async def until(probe: Any, *, within: float, what: str) -> Any:
    deadline = time.monotonic() + within
    last = None
    while time.monotonic() < deadline:
        last = await asyncio.to_thread(probe)
        if last:
            return last
        await asyncio.sleep(0.5)
    raise AssertionError(f"timed out after {within:g}s waiting for {what}; last: {last!r}")


def user_traffic(urls: list[str]) -> None:
    messages = [{"role": "user", "content": "What does the store hold? " * 40}]
    for url in urls:
        answer = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "MiniMaxAI/MiniMax-M2.5", "messages": messages, "max_tokens": 8},
            timeout=10,
            trust_env=False,
        )
        assert answer.status_code == 200, answer.text


def metrics_page(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10, trust_env=False).text


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        if panel["type"] != "row"
        for target in panel["targets"]
    ]


def concrete(expr: str) -> str:
    """Grafana's variables as the dashboard's "All" and a short time range would set them."""
    for variable, value in (
        ("$namespace", ".*"),
        ("$name", ".*"),
        ("$__rate_interval", "30s"),
        ("$__range", "5m"),
    ):
        expr = expr.replace(variable, value)
    return expr


def alert_states(prometheus: PrometheusServer, name: str) -> list[dict[str, Any]]:
    return [a for a in prometheus.get("/api/v1/alerts")["alerts"] if a["labels"]["alertname"] == name]


async def test_prometheus_scrapes_the_operator_loads_the_rules_and_sees_the_failed_canary(
    kube: KubeClient,
    namespace: str,
    crd: None,
    fakes: FakeCluster,
    settings: OperatorSettings,
    tmp_path: Path,
) -> None:
    honor_labels = chart_honor_labels(tmp_path)
    assert honor_labels
    fakes[1].mode = Mode.US_EAST  # replica 1 corrupts answers computed from a loaded prefix
    port = free_port()
    settings = dataclasses.replace(settings, metrics_host="127.0.0.1", metrics_port=port)
    configs = scrape_configs(port, namespace, list(fakes.urls), honor_labels)
    with run_operator(settings), running_prometheus(configs, rule_files=[RULES]) as prometheus:
        async with FakeKubelet(kube, namespace):
            await kube.create(serving(namespace))
            await wait_for_phase(kube, namespace, "CanaryFailed")

            seen: list[list[tuple[str, str, str]]] = []

            def targets_up() -> list[tuple[str, str, str]] | None:
                targets = prometheus.get("/api/v1/targets")["activeTargets"]
                seen.append([(t["scrapeUrl"], t["health"], t.get("lastError", "")) for t in targets])
                every = len(targets) == 1 + len(fakes.urls)  # the operator and each fake replica
                return seen[-1] if every and {t["health"] for t in targets} == {"up"} else None

            try:
                await until(targets_up, within=20, what="the operator and every replica scraped")
            except AssertionError as error:
                raise AssertionError(f"{error}; targets: {seen[-1:]}") from None
            # Users' requests, now that Prometheus has seen the counters before them: the hit ratio's rate
            # needs a rise between two scrapes.
            await asyncio.to_thread(user_traffic, list(fakes.urls))

            # The rules load: every group, every rule healthy.
            def rules_healthy() -> list[dict[str, Any]] | None:  # "unknown" until first evaluated
                groups: list[dict[str, Any]] = prometheus.get("/api/v1/rules")["groups"]
                healthy = all(rule["health"] == "ok" for group in groups for rule in group["rules"])
                return groups if groups and healthy else None

            groups = await until(rules_healthy, within=20, what="every rule evaluated without error")
            assert {group["file"] for group in groups} == {str(RULES)}
            loaded = {rule["name"] for group in groups for rule in group["rules"]}
            assert {"MooncakeCanaryFailed", "MooncakeOperatorNotLeading"} <= loaded

            failed = 'mooncake_operator_canary_verdict{verdict="Failed", name="demo"} == 1'
            verdicts = await until(lambda: prometheus.query(failed), within=20, what="the failed verdict")
            # honorLabels: the resource's namespace, not the operator's, and nothing renamed.
            assert [v["metric"]["namespace"] for v in verdicts] == [namespace]
            assert "exported_namespace" not in verdicts[0]["metric"]
            series = prometheus.get(
                "/api/v1/series", **{"match[]": '{__name__=~"mooncake_operator_.*",name="demo"}'}
            )
            assert series and {s["namespace"] for s in series} == {namespace}
            # Operator-wide series take the target's namespace.
            (leading,) = prometheus.query("mooncake_operator_leading")
            assert leading["metric"]["namespace"] == OPERATOR_NAMESPACE and leading["value"][1] == "1"

            def canary_alert() -> list[dict[str, Any]]:
                return [
                    a
                    for a in alert_states(prometheus, "MooncakeCanaryFailed")
                    if a["state"] in ("pending", "firing")
                ]

            (alert,) = await until(canary_alert, within=20, what="MooncakeCanaryFailed pending")
            assert (alert["labels"]["namespace"], alert["labels"]["name"]) == (namespace, "demo")
            # The resource has never been Ready (its first canary failed): a warning, not a page.
            assert alert["labels"]["severity"] == "warning"
            # The leading operator keeps MooncakeOperatorNotLeading quiet. It may be pending for a moment: an
            # evaluation between a scrape that timed out (1 s, on a loaded machine) and the next finds the
            # series stale; it must clear, and never fire.
            not_leading = alert_states(prometheus, "MooncakeOperatorNotLeading")
            assert all(a["state"] != "firing" for a in not_leading), not_leading
            await until(
                lambda: not alert_states(prometheus, "MooncakeOperatorNotLeading"),
                within=20,
                what="MooncakeOperatorNotLeading to clear while the operator leads",
            )

            # The running operator's own page passes promtool's lint.
            page = await asyncio.to_thread(metrics_page, port)
            assert 'mooncake_operator_canary_cause{cause="answer_mismatch"' in page
            checked = promtool("check", "metrics", stdin=page)
            assert checked.returncode == 0 and not checked.stdout.strip(), checked.stdout + checked.stderr

            # Every dashboard query: valid here, and returning series unless this scenario has none.
            await until(
                lambda: prometheus.query("mooncake:vllm_external_prefix_cache_hit_ratio:rate15m"),
                within=20,
                what="the hit-ratio recording rule",
            )
            empty = []
            for title, expr in dashboard_queries():
                if not prometheus.query(concrete(expr)):
                    empty.append(title)
            assert set(empty) == EMPTY_HERE, empty
