"""The chart's monitoring objects (PrometheusRule, engine PodMonitor, dashboard): rendered only when asked."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.support.chart import (
    CHART_DIR,
    RELEASE_NAMESPACE,
    SERVICE_MONITOR_API,
    by_kind,
    only,
    render,
    render_failure,
)

from mooncake_operator.build.names import (
    COMPONENT_MASTER,
    COMPONENT_REPLICA,
    HTTP_PORT_NAME,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    TRAFFIC_LABEL,
)

pytestmark = pytest.mark.unit

RULE_API = "monitoring.coreos.com/v1/PrometheusRule"
POD_MONITOR_API = "monitoring.coreos.com/v1/PodMonitor"
EVERY_API = (SERVICE_MONITOR_API, RULE_API, POD_MONITOR_API)
RULES_FILE = CHART_DIR / "files" / "prometheus-rules.yaml"
DASHBOARD_FILE = CHART_DIR / "dashboards" / "mooncake-operator.json"
ALL_ON = {
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
    "monitoring": {
        "prometheusRule": {
            "enabled": True,
            "labels": {"release": "kube-prometheus-stack"},
            "runbookBaseUrl": "https://git.example.com/mo/blob/v1/docs/runbooks.md",
        },
        "enginePodMonitor": {
            "enabled": True,
            "labels": {"release": "kube-prometheus-stack"},
            "interval": "15s",
        },
        "dashboard": {"enabled": True, "annotations": {"grafana_folder": "Mooncake"}},
    },
}


def dashboards(manifests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in by_kind(manifests, "ConfigMap") if "mooncake-operator.json" in (m.get("data") or {})]


def test_nothing_is_rendered_unless_asked(tmp_path: Path) -> None:
    manifests = render({}, tmp_path, api_versions=EVERY_API)
    assert not by_kind(manifests, "ServiceMonitor")
    assert not by_kind(manifests, "PrometheusRule")
    assert not by_kind(manifests, "PodMonitor")
    assert not dashboards(manifests)


def test_the_service_monitor_honours_the_operators_labels(tmp_path: Path) -> None:
    monitor = only(render(ALL_ON, tmp_path, api_versions=EVERY_API), "ServiceMonitor")
    assert [endpoint["honorLabels"] for endpoint in monitor["spec"]["endpoints"]] == [True]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def alert_rules(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [rule for group in spec["groups"] for rule in group["rules"] if "alert" in rule]


def test_the_prometheus_rule_is_the_plain_rules_file_with_the_runbook_base(tmp_path: Path) -> None:
    rule = only(render(ALL_ON, tmp_path, api_versions=EVERY_API), "PrometheusRule")
    assert rule["metadata"]["namespace"] == RELEASE_NAMESPACE
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    base = "https://git.example.com/mo/blob/v1/docs/runbooks.md"
    expected = yaml.safe_load(RULES_FILE.read_text())
    for alert in alert_rules(expected):
        alert["annotations"]["runbook_url"] = f"{base}#{alert['alert'].lower()}"
    assert rule["spec"] == expected
    # Prometheus's own templates reach it untouched (helm does not evaluate the file).
    assert "{{ $labels.namespace }}" in json.dumps(rule["spec"])


def test_runbook_links_default_to_this_releases_published_runbooks(tmp_path: Path) -> None:
    """Absolute, versioned with the chart, and the same links the plain rules file carries."""
    values = {"monitoring": {"prometheusRule": {"enabled": True}}}
    rule = only(render(values, tmp_path, api_versions=(RULE_API,)), "PrometheusRule")
    version = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["appVersion"]
    published = f"https://mooncake-operator.dev/docs/v{version}/runbooks"
    urls = {alert["alert"]: alert["annotations"]["runbook_url"] for alert in alert_rules(rule["spec"])}
    assert urls and all(url == f"{published}#{name.lower()}" for name, url in urls.items()), urls
    plain_rules = alert_rules(yaml.safe_load(RULES_FILE.read_text()))
    plain = {alert["alert"]: alert["annotations"]["runbook_url"] for alert in plain_rules}
    assert plain == urls


def test_the_first_rollout_warning_waits_as_long_as_the_value_says(tmp_path: Path) -> None:
    def waits(values: dict[str, Any]) -> list[str]:
        rule = only(render(values, tmp_path, api_versions=(RULE_API,)), "PrometheusRule")
        return [a["for"] for a in alert_rules(rule["spec"]) if a["alert"] == "MooncakeFirstRolloutSlow"]

    assert waits({"monitoring": {"prometheusRule": {"enabled": True}}}) == ["2h"]
    longer = {"monitoring": {"prometheusRule": {"enabled": True, "firstRolloutWarningAfter": "6h30m"}}}
    assert waits(longer) == ["6h30m"]
    # Every other alert keeps the file's own `for`.
    rule = only(render(longer, tmp_path, api_versions=(RULE_API,)), "PrometheusRule")
    plain = alert_rules(yaml.safe_load(RULES_FILE.read_text()))
    others = [a.get("for") for a in alert_rules(rule["spec"]) if a["alert"] != "MooncakeFirstRolloutSlow"]
    assert others == [a.get("for") for a in plain if a["alert"] != "MooncakeFirstRolloutSlow"]


def test_the_engine_pod_monitor_selects_the_operators_replica_pods(tmp_path: Path) -> None:
    monitor = only(render(ALL_ON, tmp_path, api_versions=EVERY_API), "PodMonitor")
    pod_labels = {
        LABEL_COMPONENT: COMPONENT_REPLICA,
        LABEL_MANAGED_BY: MANAGED_BY,
    }
    assert monitor["spec"]["selector"] == {"matchLabels": pod_labels}
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == (
        HTTP_PORT_NAME,
        "/metrics",
        "15s",
    )

    def meta(label: str) -> str:  # Prometheus's name for a pod label in service discovery
        return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)

    relabel = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert relabel == {
        "mooncake_serving": [meta(LABEL_INSTANCE)],
        "traffic": [meta(TRAFFIC_LABEL)],
    }


def test_the_engine_pod_monitor_follows_the_watched_namespaces(tmp_path: Path) -> None:
    values = {**ALL_ON, "watchNamespaces": ["serving-a", "serving-b"]}
    monitor = only(render(values, tmp_path, api_versions=EVERY_API), "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["serving-a", "serving-b"]}


def test_no_pod_monitor_scrapes_the_master(tmp_path: Path) -> None:
    """Its metrics port also serves the store's admin endpoints (docs/monitoring.md)."""
    for monitor in by_kind(render(ALL_ON, tmp_path, api_versions=EVERY_API), "PodMonitor"):
        labels = monitor["spec"]["selector"]["matchLabels"]
        assert labels.get(LABEL_COMPONENT) != COMPONENT_MASTER


def test_the_dashboard_config_map_carries_the_sidecar_label_and_the_json(tmp_path: Path) -> None:
    (config_map,) = dashboards(render(ALL_ON, tmp_path, api_versions=EVERY_API))
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "Mooncake"}
    assert config_map["metadata"]["namespace"] == RELEASE_NAMESPACE
    assert json.loads(config_map["data"]["mooncake-operator.json"]) == json.loads(DASHBOARD_FILE.read_text())


def test_the_dashboard_label_and_namespace_are_settable(tmp_path: Path) -> None:
    """Another sidecar label instead of the default one (null removes a default key in helm)."""
    values = {
        "monitoring": {
            "dashboard": {
                "enabled": True,
                "labels": {"dashboards": "grafana", "grafana_dashboard": None},
                "namespace": "grafana",
            }
        }
    }
    (config_map,) = dashboards(render(values, tmp_path))
    assert config_map["metadata"]["namespace"] == "grafana"
    assert config_map["metadata"]["labels"]["dashboards"] == "grafana"
    assert "grafana_dashboard" not in config_map["metadata"]["labels"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"monitoring": {"prometheusRule": {"enabled": True}}}, "no monitoring.coreos.com/v1 PrometheusRule"),
        ({"monitoring": {"enginePodMonitor": {"enabled": True}}}, "no monitoring.coreos.com/v1 PodMonitor"),
        ({"monitoring": {"prometheusRule": {"runbookBaseUrl": "docs/runbooks.md"}}}, "runbookBaseUrl"),
        ({"monitoring": {"enginePodMonitor": {"interval": "often"}}}, "interval"),
        ({"monitoring": {"dashboard": {"labels": {"grafana_dashboard": 1}}}}, "grafana_dashboard"),
        ({"monitoring": {"masterPodMonitor": {"enabled": True}}}, "masterPodMonitor is not allowed"),
    ],
    ids=[
        "rule-without-api",
        "pod-monitor-without-api",
        "relative-runbook-base",
        "bad-interval",
        "label-not-text",
        "no-master-monitor",
    ],
)
def test_bad_monitoring_values_are_refused(values: dict[str, Any], message: str, tmp_path: Path) -> None:
    assert message in render_failure(values, tmp_path)


def test_the_dashboard_is_a_grafana_dashboard_over_prometheus() -> None:
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    assert dashboard["uid"] == "mooncake-operator"
    rows = [panel["title"] for panel in dashboard["panels"] if panel["type"] == "row"]
    assert rows == ["What users feel", "Fleet", "Canary", "vLLM and the store", "Master", "Operator"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and all(target["expr"] for target in panel["targets"]), panel["title"]


def test_the_first_row_shows_what_users_feel_from_vllms_own_series() -> None:
    """Time to first token and inter-token latency (quantiles of vLLM's histograms), the queue, KV-cache
    usage. That vLLM exports these names: tests/engine/test_vllm_series.py, against vLLM's source."""
    panels = json.loads(DASHBOARD_FILE.read_text())["panels"]
    first_row_end = next(i for i, panel in enumerate(panels[1:], 1) if panel["type"] == "row")
    assert panels[0]["title"] == "What users feel"
    exprs = {panel["title"]: [t["expr"] for t in panel["targets"]] for panel in panels[1:first_row_end]}
    assert list(exprs) == [
        "Time to first token",
        "Inter-token latency",
        "Requests waiting and running",
        "KV-cache usage by replica",
    ]
    for title, histogram in (
        ("Time to first token", "vllm:time_to_first_token_seconds_bucket"),
        ("Inter-token latency", "vllm:inter_token_latency_seconds_bucket"),
    ):
        quantiles = [re.match(r"histogram_quantile\(([0-9.]+), sum by \(le, ", e) for e in exprs[title]]
        assert [q.group(1) for q in quantiles if q] == ["0.5", "0.95", "0.99"], title
        assert all(histogram in expr for expr in exprs[title]), title
    assert any("vllm:num_requests_waiting{" in expr for expr in exprs["Requests waiting and running"])
    assert any("vllm:kv_cache_usage_perc{" in expr for expr in exprs["KV-cache usage by replica"])
    for expr in (e for es in exprs.values() for e in es):
        assert 'namespace=~"$namespace", mooncake_serving=~"$name"' in expr, expr
