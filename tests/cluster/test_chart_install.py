"""The helm chart against a real kube-apiserver (1.20, RBAC on): every rendered object passes a
server-side dry run, and `helm install` applies the chart.

The operator running under the chart's ServiceAccount is in test_chart_operator_rbac.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.support.apiserver import ControlPlane
from tests.support.chart import (
    CHART_DIR,
    Manifest,
    by_kind,
    is_helm_test_hook,
    parse_manifests,
    render,
    run_helm,
)

from mooncake_operator.api import crd
from mooncake_operator.kube.client import KubeClient

MANAGER = "mooncake-chart-test"
CRD_PATH = CHART_DIR.parents[1] / "crds" / crd.CRD_FILENAME
# The CRD is a chart template: a release adopts the one the session's other tests applied (as a cluster
# upgraded from a chart with crds/ does, docs/install.md#upgrading).
ADOPT_CRD = "--take-ownership"


def crd_manifest() -> Manifest:
    crd: Manifest = yaml.safe_load(CRD_PATH.read_text(encoding="utf-8"))
    return crd


async def apply_namespace(kube: KubeClient, name: str) -> None:
    await kube.apply(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}, field_manager=MANAGER
    )


@pytest.fixture
async def second_namespace(kube: KubeClient) -> AsyncIterator[str]:
    name = f"t-{uuid.uuid4().hex[:10]}"
    await apply_namespace(kube, name)
    yield name
    await kube.delete("v1", "Namespace", name)


def unique_release() -> str:
    return f"r{uuid.uuid4().hex[:8]}"


def value_sets(namespace: str, other: str) -> dict[str, dict[str, Any]]:
    return {
        "defaults": {},
        "namespaced": {"watchNamespaces": [namespace, other]},
        "everything": {
            "watchNamespaces": [other],
            "serviceAccount": {"name": "operator", "annotations": {"team": "inference"}},
            "operator": {"extraArgs": ["--resync-seconds=60"], "extraEnv": [{"name": "TZ", "value": "UTC"}]},
            "metrics": {"port": 9191, "service": {"port": 8443}},
            "imagePullSecrets": [{"name": "regcred"}],
            "priorityClassName": "system-cluster-critical",
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
            "test": {"servingName": "minimax-m25", "servingNamespace": other, "extraArgs": ["--timeout=600"]},
        },
    }


TOKEN_SECRET_WAIT_S = 30.0


async def wait_for_token_secret(kube: KubeClient, namespace: str, name: str) -> None:
    """The controller-manager adds a token Secret to a new ServiceAccount; Pods using it wait for it."""
    deadline = time.monotonic() + TOKEN_SECRET_WAIT_S
    while time.monotonic() < deadline:
        if (await kube.get("v1", "ServiceAccount", name, namespace)).get("secrets"):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(
        f"{namespace}/{name}: no token Secret after {TOKEN_SECRET_WAIT_S}s (controller-manager down?)"
    )


@pytest.mark.parametrize("value_set", ["defaults", "namespaced", "everything"])
async def test_every_rendered_object_passes_a_server_side_dry_run(
    kube: KubeClient, namespace: str, second_namespace: str, value_set: str, tmp_path: Path
) -> None:
    """The API server itself (1.20: the oldest Kubernetes the chart declares) validates every object,
    the test Pod included; nothing is stored but the test Pod's ServiceAccount (below)."""
    await kube.apply(crd_manifest(), field_manager=MANAGER, dry_run=True)
    values = value_sets(namespace, second_namespace)[value_set]
    manifests = render(values, tmp_path, namespace=namespace, include_crds=False)
    # The Prometheus Operator's CRD is not on this API server; its ServiceMonitor is checked offline.
    assert not by_kind(manifests, "ServiceMonitor")
    if value_set == "everything":
        assert [m for m in manifests if is_helm_test_hook(m)], "the test Pod must be dry-run too"
        # Admission looks up the test Pod's own ServiceAccount and (1.20) its token Secret, which a dry
        # run never stores: that one account is created for real (deleted with the namespace).
        account = next(
            m for m in by_kind(manifests, "ServiceAccount") if m["metadata"]["name"].endswith("-canary")
        )
        await kube.apply(account, field_manager=MANAGER)
        await wait_for_token_secret(kube, namespace, account["metadata"]["name"])
    for manifest in manifests:
        answer = await kube.apply(manifest, field_manager=MANAGER, dry_run=True)
        assert answer["kind"] == manifest["kind"]
        assert answer["metadata"]["name"] == manifest["metadata"]["name"]
    assert not await kube.list("apps/v1", "Deployment", namespace), "a dry run stored something"


async def test_the_service_monitor_needs_the_monitoring_api_on_the_server(
    kube_cluster: ControlPlane, namespace: str
) -> None:
    """helm install asks the server which APIs it has: without the Prometheus Operator, a requested
    ServiceMonitor stops the install before anything is created."""
    result = run_helm(
        [
            "install",
            unique_release(),
            str(CHART_DIR),
            "--namespace",
            namespace,
            "--set",
            "metrics.serviceMonitor.enabled=true",
        ],
        env={"KUBECONFIG": str(kube_cluster.kubeconfig)},
    )
    assert result.returncode != 0
    assert "the cluster has no monitoring.coreos.com/v1 ServiceMonitor" in result.stderr


@pytest.fixture
def installed(kube_cluster: ControlPlane, namespace: str) -> Iterator[tuple[str, str]]:
    """`helm install` of the chart with default values into a fresh namespace; uninstalled after."""
    release = unique_release()
    env = {"KUBECONFIG": str(kube_cluster.kubeconfig)}
    result = run_helm(
        ["install", release, str(CHART_DIR), "--namespace", namespace, ADOPT_CRD], env=env
    ).check()
    try:
        yield release, result.stdout
    finally:
        run_helm(["uninstall", release, "--namespace", namespace], env=env).check()


async def test_helm_install_creates_every_object_of_the_chart(
    kube: KubeClient, kube_cluster: ControlPlane, namespace: str, installed: tuple[str, str]
) -> None:
    release, output = installed
    fullname = f"{release}-mooncake-operator"
    crd = await kube.get(
        "apiextensions.k8s.io/v1", "CustomResourceDefinition", crd_manifest()["metadata"]["name"]
    )
    assert crd["spec"]["names"]["shortNames"] == ["mcs"]
    deployment = await kube.get("apps/v1", "Deployment", fullname, namespace)
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    assert deployment["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    await kube.get("v1", "ServiceAccount", fullname, namespace)
    await kube.get("v1", "Service", f"{fullname}-metrics", namespace)
    for suffix in ("framework", "application"):
        await kube.get("rbac.authorization.k8s.io/v1", "ClusterRole", f"{fullname}-{suffix}")
        binding = await kube.get("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", f"{fullname}-{suffix}")
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": fullname, "namespace": namespace}]
    # What helm stored is what `helm template` renders.
    manifest = run_helm(
        ["get", "manifest", release, "--namespace", namespace],
        env={"KUBECONFIG": str(kube_cluster.kubeconfig)},
    ).check()
    assert sorted(m["kind"] for m in parse_manifests(manifest.stdout)) == sorted(
        [
            "CustomResourceDefinition",
            "ServiceAccount",
            "Service",
            "Deployment",
            "ClusterRole",
            "ClusterRole",
            "ClusterRoleBinding",
            "ClusterRoleBinding",
            "Role",  # leader election, in the release namespace
            "RoleBinding",
        ]
    )
    # NOTES.txt: what to do next, with this release's names.
    assert f"kubectl -n {namespace} rollout status deployment/{fullname}" in output
    assert "kubectl get mcs" in output
    assert "kubectl wait --for=condition=Ready mcs/quickstart" in output  # docs/quickstart.md's resource
    assert f"helm test {release} -n {namespace} --logs" in output
    assert "--set test.servingName=quickstart" in output


async def test_helm_uninstall_keeps_the_crd_and_removes_the_rest(
    kube: KubeClient, kube_cluster: ControlPlane, namespace: str
) -> None:
    """The CRD template is kept on uninstall (deleting it would delete every MooncakeServing)."""
    release = unique_release()
    env = {"KUBECONFIG": str(kube_cluster.kubeconfig)}
    run_helm(["install", release, str(CHART_DIR), "--namespace", namespace, ADOPT_CRD], env=env).check()
    run_helm(["uninstall", release, "--namespace", namespace], env=env).check()
    fullname = f"{release}-mooncake-operator"
    assert (
        await kube.get_or_none("rbac.authorization.k8s.io/v1", "ClusterRole", f"{fullname}-framework") is None
    )
    assert await kube.get_or_none("apps/v1", "Deployment", fullname, namespace) is None
    name = crd_manifest()["metadata"]["name"]
    assert await kube.get_or_none("apiextensions.k8s.io/v1", "CustomResourceDefinition", name) is not None
