"""Render the helm chart (charts/mooncake-operator) with the helm binary scripts/fetch-helm provides.

Shared by the chart's unit tests (offline rendering and validation) and its cluster tests (server-side
dry runs, `helm install` against the harness's API server, the operator run under the chart's RBAC).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from tests.support.apiserver import cache_root

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "charts" / "mooncake-operator"
RELEASE = "mooncake"
RELEASE_NAMESPACE = "mooncake-system"
SERVICE_MONITOR_API = "monitoring.coreos.com/v1/ServiceMonitor"

Manifest = dict[str, Any]


def helm_binary() -> Path:
    """The helm binary, or a failure that names the command providing it (never a skip)."""
    helm = cache_root() / "bin" / "helm"
    if not os.access(helm, os.X_OK):
        raise AssertionError(f"helm not found at {helm}: run scripts/fetch-helm")
    return helm


@dataclass(frozen=True)
class HelmResult:
    returncode: int
    stdout: str
    stderr: str

    def check(self) -> HelmResult:
        assert self.returncode == 0, f"helm failed ({self.returncode}):\n{self.stderr}{self.stdout}"
        return self


def run_helm(
    args: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 120
) -> HelmResult:
    """Runs helm with its caches and config in a throw-away place (never the user's ~/.config/helm)."""
    full_env = {**os.environ, **(env or {})}
    scratch = cache_root() / "helm-home"
    for variable, sub in (
        ("HELM_CACHE_HOME", "cache"),
        ("HELM_CONFIG_HOME", "config"),
        ("HELM_DATA_HOME", "data"),
    ):
        full_env.setdefault(variable, str(scratch / sub))
    completed = subprocess.run(
        [str(helm_binary()), *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        check=False,
    )
    return HelmResult(completed.returncode, completed.stdout, completed.stderr)


def values_file(values: Mapping[str, Any], directory: Path) -> Path:
    """Writes values as a YAML file (types survive, unlike --set's string guessing)."""
    descriptor, name = tempfile.mkstemp(prefix="values-", suffix=".yaml", dir=directory)
    with os.fdopen(descriptor, "w", encoding="utf-8") as out:
        yaml.safe_dump(dict(values), out)
    return Path(name)


def template_args(
    values_path: Path | None = None,
    *,
    release: str = RELEASE,
    namespace: str = RELEASE_NAMESPACE,
    api_versions: Sequence[str] = (),
    extra: Sequence[str] = (),
) -> list[str]:
    args = ["template", release, str(CHART_DIR), "--namespace", namespace]
    if values_path is not None:
        args += ["--values", str(values_path)]
    for api_version in api_versions:
        args += ["--api-versions", api_version]
    return [*args, *extra]


def parse_manifests(stream: str) -> list[Manifest]:
    return [doc for doc in yaml.safe_load_all(stream) if doc]


def render(
    values: Mapping[str, Any] | None,
    tmp_path: Path,
    *,
    api_versions: Sequence[str] = (),
    include_crds: bool = False,
    namespace: str = RELEASE_NAMESPACE,
) -> list[Manifest]:
    """`helm template` of the chart with these values: every object, hooks (the test Pod) included."""
    path = values_file(values, tmp_path) if values else None
    extra = ["--include-crds"] if include_crds else []
    result = run_helm(
        template_args(path, api_versions=api_versions, extra=extra, namespace=namespace)
    ).check()
    return parse_manifests(result.stdout)


def render_failure(values: Mapping[str, Any], tmp_path: Path, *, api_versions: Sequence[str] = ()) -> str:
    """The error helm prints when these values are refused; fails if helm accepts them."""
    result = run_helm(template_args(values_file(values, tmp_path), api_versions=api_versions))
    assert result.returncode != 0, f"helm accepted {dict(values)}:\n{result.stdout}"
    return result.stderr


def by_kind(manifests: Sequence[Manifest], kind: str) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind]


def only(manifests: Sequence[Manifest], kind: str) -> Manifest:
    found = by_kind(manifests, kind)
    assert len(found) == 1, f"expected one {kind}, found {[m['metadata']['name'] for m in found]}"
    return found[0]


def operator_container(manifests: Sequence[Manifest]) -> Manifest:
    container: Manifest = only(manifests, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return container


def is_helm_test_hook(manifest: Manifest) -> bool:
    annotations = manifest["metadata"].get("annotations") or {}
    return annotations.get("helm.sh/hook") == "test"
