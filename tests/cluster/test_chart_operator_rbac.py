"""The operator, run exactly as the chart runs it and with nothing but the chart's ServiceAccount token,
does its whole job on a real API server with RBAC on, and is refused what it does not need.

For each RBAC layout (a cluster-wide watch: ClusterRoles; a namespaced watch: a Role per namespace):
`helm install` the chart, mint a token for its ServiceAccount (TokenRequest), and start
`mooncake-operator` with the Deployment's own arguments (ports moved to free loopback ones, a
kubeconfig holding that token, the replicas mapped to loopback fake vLLM servers, short resync
periods). Then, as an admin, create a MooncakeServing and play the kubelet, and watch the operator:
apply every child, write status, post events; fail the
canary against a corrupting replica and hold that replica out of traffic (a pod label patch); pass it
after a rerun, putting the replica back and storing the last good revision. Its log must show no
refusal. Finally the same token is tried on what the operator must not do.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from tests.cluster.operator_harness import FakeKubelet, eventually, serving
from tests.support.apiserver import ControlPlane, free_port
from tests.support.chart import CHART_DIR, Manifest, only, parse_manifests, run_helm
from tests.support.fake_vllm import FakeCluster, Mode

from mooncake_operator.api.group import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    RERUN_CANARY_ANNOTATION,
    VERSION,
)
from mooncake_operator.api.resource import parse_resource
from mooncake_operator.build.disruption import POLICY_V1, POLICY_V1BETA1
from mooncake_operator.build.manifests import render_all
from mooncake_operator.build.names import TRAFFIC_LABEL, TRAFFIC_OFF, TRAFFIC_ON, ChildNames
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.reconcile.decide.revisions import config_map_name

MANAGER = "mooncake-chart-rbac-test"
SERVING = "minimax-m25"
OPERATOR_START_TIMEOUT_S = 60.0
RECONCILE_TIMEOUT_S = 60.0
# Operator-level flags the chart passes through operator.extraArgs: short periods, so the test is quick;
# --debug, so every API request is logged with its HTTP status and a refusal cannot go unseen.
OPERATOR_TEST_FLAGS = [
    "--resync-seconds=1",
    "--retry-delay-seconds=0.5",
    "--inconclusive-retry-seconds=2",
    "--debug",
]


@dataclass(frozen=True)
class Installed:
    release: str
    namespace: str  # the release's (the operator's) namespace
    serving_namespace: str  # where the MooncakeServing lives
    other_namespace: str  # watched only in the cluster-wide layout
    manifests: list[Manifest]

    @property
    def service_account(self) -> str:
        name: str = only(self.manifests, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
        return name

    @property
    def operator_args(self) -> list[str]:
        args: list[str] = only(self.manifests, "Deployment")["spec"]["template"]["spec"]["containers"][0][
            "args"
        ]
        return args


async def make_namespace(kube: KubeClient) -> str:
    name = f"t-{uuid.uuid4().hex[:10]}"
    await kube.apply(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}, field_manager=MANAGER
    )
    return name


@pytest.fixture(params=["cluster-wide", "namespaced"])
async def installed(
    request: pytest.FixtureRequest, kube_cluster: ControlPlane, kube: KubeClient, namespace: str
) -> AsyncIterator[Installed]:
    serving_namespace = await make_namespace(kube)
    other_namespace = await make_namespace(kube)
    release = f"r{uuid.uuid4().hex[:8]}"
    # --take-ownership: the CRD (a chart template) exists already, applied by the session's other tests.
    args = ["install", release, str(CHART_DIR), "--namespace", namespace, "--take-ownership"]
    if request.param == "namespaced":
        args += ["--set", f"watchNamespaces={{{serving_namespace}}}"]
    env = {"KUBECONFIG": str(kube_cluster.kubeconfig)}
    run_helm(args, env=env).check()
    try:
        manifest = run_helm(["get", "manifest", release, "--namespace", namespace], env=env).check()
        yield Installed(
            release, namespace, serving_namespace, other_namespace, parse_manifests(manifest.stdout)
        )
    finally:
        run_helm(["uninstall", release, "--namespace", namespace], env=env).check()
        for name in (serving_namespace, other_namespace):
            await kube.delete("v1", "Namespace", name)


def local_operator_argv(
    chart_args: list[str], kubeconfig: Path, liveness_port: int, extra: list[str]
) -> list[str]:
    """The Deployment's arguments, with what only makes sense in a pod moved to this machine: probes on
    free loopback ports, credentials from a kubeconfig (the pod would use its mounted token)."""
    argv: list[str] = []
    for arg in chart_args:
        if arg.startswith("--liveness-port="):
            argv += [f"--liveness-port={liveness_port}", "--liveness-host=127.0.0.1"]
        elif arg.startswith("--metrics-port="):
            argv += [f"--metrics-port={free_port()}", "--metrics-host=127.0.0.1"]
        else:
            argv.append(arg)
    assert argv[0] == "run", chart_args
    return [sys.executable, "-m", "mooncake_operator", *argv, f"--kubeconfig={kubeconfig}", *extra]


@contextlib.contextmanager
def running_operator(
    argv: list[str], log_path: Path, liveness_port: int
) -> Iterator[subprocess.Popen[bytes]]:
    # Only the token in the kubeconfig: no admin kubeconfig, no in-cluster variables to fall back on.
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG" and not k.startswith("KUBERNETES_")}
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for_liveness(process, liveness_port, log_path)
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=15)


def operator_log(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def wait_for_liveness(process: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
    deadline = time.monotonic() + OPERATOR_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the operator exited with {process.returncode}:\n{operator_log(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).is_success:
                return
        time.sleep(0.2)
    raise AssertionError(f"no /healthz within {OPERATOR_START_TIMEOUT_S}s:\n{operator_log(log_path)}")


def expected_children(namespace: str, policy_api_version: str) -> list[tuple[str, str, str]]:
    resource = parse_resource(serving(namespace, SERVING))
    return [
        (m["apiVersion"], m["kind"], m["metadata"]["name"])
        for m in render_all(resource, owner_uid=None, policy_api_version=policy_api_version)
    ]


async def reconciled(kube: KubeClient, namespace: str) -> list[str]:
    """What is still missing of the operator's work on the MooncakeServing (empty: all done)."""
    missing = []
    resource = await kube.get(API_VERSION, KIND, SERVING, namespace)
    status = resource.get("status") or {}
    if not status.get("phase") or not status.get("conditions"):
        missing.append("status")
    # The PodDisruptionBudget's version the server serves, as the operator picks it (1.20: v1beta1).
    policy = POLICY_V1 if "v1" in await kube.served_versions("policy") else POLICY_V1BETA1
    for api_version, kind, name in expected_children(namespace, policy):
        child = await kube.get_or_none(api_version, kind, name, namespace)
        if child is None:
            missing.append(f"{kind}/{name}")
        elif child["metadata"]["ownerReferences"][0]["uid"] != resource["metadata"]["uid"]:
            missing.append(f"owner reference of {kind}/{name}")
    events = await kube.list("v1", "Event", namespace, field_selector=f"involvedObject.name={SERVING}")
    if not [e for e in events if (e.get("source") or {}).get("component") == "mooncake-operator"]:
        missing.append("event")
    return missing


async def wait_until_reconciled(kube: KubeClient, namespace: str, log_path: Path) -> None:
    deadline = time.monotonic() + RECONCILE_TIMEOUT_S
    missing = await reconciled(kube, namespace)
    while missing and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        missing = await reconciled(kube, namespace)
    assert not missing, (
        f"after {RECONCILE_TIMEOUT_S}s still missing {missing}; operator log:\n{operator_log(log_path)}"
    )


async def wait_until_deleted(kube: KubeClient, namespace: str, log_path: Path) -> None:
    deadline = time.monotonic() + RECONCILE_TIMEOUT_S
    while await kube.get_or_none(API_VERSION, KIND, SERVING, namespace) is not None:
        assert time.monotonic() < deadline, f"resource not deleted; operator log:\n{operator_log(log_path)}"
        await asyncio.sleep(0.5)


def forbidden_requests(installed: Installed) -> list[tuple[str, str, dict[str, Any] | None]]:
    """(method, path, body) the operator has no business making; each must get 403."""
    ns = installed.serving_namespace
    names = ChildNames.of(SERVING)
    requests: list[tuple[str, str, dict[str, Any] | None]] = [
        ("DELETE", f"/api/v1/namespaces/{ns}", None),
        ("GET", f"/api/v1/namespaces/{ns}/secrets", None),
        ("GET", f"/api/v1/namespaces/{ns}/secrets/hf-token", None),
        ("GET", "/api/v1/nodes", None),
        ("GET", f"/api/v1/namespaces/{installed.namespace}/secrets", None),
        ("DELETE", f"/api/v1/namespaces/{ns}/configmaps/{names.store_config}", None),
        ("DELETE", f"/api/v1/namespaces/{ns}/services/{names.client_service}", None),
        ("DELETE", f"/apis/apps/v1/namespaces/{ns}/deployments/{names.master}", None),
        ("DELETE", f"/api/v1/namespaces/{ns}/pods", None),
        ("DELETE", f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}/{SERVING}", None),
        # The spec is the user's: the operator writes the status subresource only.
        ("PATCH", f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}/{SERVING}", {"spec": {"replicas": 3}}),
        ("DELETE", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{PLURAL}.{GROUP}", None),
        ("GET", "/apis/rbac.authorization.k8s.io/v1/clusterroles", None),
        (
            "POST",
            "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": f"{installed.release}-escalate"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": "cluster-admin",
                },
                "subjects": [
                    {
                        "kind": "ServiceAccount",
                        "name": installed.service_account,
                        "namespace": installed.namespace,
                    }
                ],
            },
        ),
        ("POST", f"/api/v1/namespaces/{ns}/pods/{names.replicas}-0/exec?command=true", None),
        ("GET", f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings", None),
    ]
    if "--namespace" in " ".join(installed.operator_args):
        # A namespaced watch: nothing of the application's reaches beyond the watched namespace.
        other = installed.other_namespace
        requests += [
            ("GET", f"/apis/{GROUP}/{VERSION}/{PLURAL}", None),
            ("GET", f"/apis/{GROUP}/{VERSION}/namespaces/{other}/{PLURAL}", None),
            ("GET", f"/api/v1/namespaces/{other}/pods", None),
            (
                "POST",
                f"/api/v1/namespaces/{other}/configmaps",
                {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": other}},
            ),
        ]
    return requests


async def phase_reached(kube: KubeClient, namespace: str, phase: str, log_path: Path) -> dict[str, Any]:
    deadline = time.monotonic() + RECONCILE_TIMEOUT_S
    while True:
        resource = await kube.get(API_VERSION, KIND, SERVING, namespace)
        status = resource.get("status") or {}
        if status.get("phase") == phase:
            return resource
        if time.monotonic() > deadline:
            raise AssertionError(
                f"no phase {phase} after {RECONCILE_TIMEOUT_S}s; status: {status}\n"
                f"operator log:\n{operator_log(log_path)}"
            )
        await asyncio.sleep(0.2)


async def traffic_label(kube: KubeClient, namespace: str, pod: str) -> str | None:
    labels = (await kube.get("v1", "Pod", pod, namespace))["metadata"].get("labels") or {}
    value: str | None = labels.get(TRAFFIC_LABEL)
    return value


async def test_operator_under_the_charts_service_account_does_its_job_and_nothing_more(
    kube_cluster: ControlPlane, kube: KubeClient, installed: Installed, tmp_path: Path
) -> None:
    namespace = installed.serving_namespace
    token = kube_cluster.service_account_token(installed.namespace, installed.service_account)
    kubeconfig = kube_cluster.write_kubeconfig(tmp_path / "operator.kubeconfig", token, "operator")
    liveness_port = free_port()
    log_path = tmp_path / "operator.log"
    replica = f"{ChildNames.of(SERVING).replicas}-1"

    # Replica 1 corrupts answers computed from a loaded prefix: the canary must fail and blame it.
    with FakeCluster.start(2, modes=[Mode.CORRECT, Mode.US_EAST]) as fakes:
        endpoints = tmp_path / "endpoints.yaml"
        endpoints.write_text(yaml.safe_dump({f"{namespace}/{SERVING}": fakes.urls}))
        extra = [f"--replica-endpoints={endpoints}", *OPERATOR_TEST_FLAGS]
        argv = local_operator_argv(installed.operator_args, kubeconfig, liveness_port, extra)
        with running_operator(argv, log_path, liveness_port):
            await kube.create(serving(namespace, SERVING))
            await wait_until_reconciled(kube, namespace, log_path)
            async with FakeKubelet(kube, namespace):
                failed = await phase_reached(kube, namespace, "CanaryFailed", log_path)
                assert failed["status"]["outOfTraffic"] == [replica]
                assert await traffic_label(kube, namespace, replica) == TRAFFIC_OFF

                fakes[1].mode = Mode.CORRECT
                rerun = {"metadata": {"annotations": {RERUN_CANARY_ANNOTATION: "after-fix"}}}
                await kube.patch_merge(API_VERSION, KIND, SERVING, rerun, namespace)
                ready = await phase_reached(kube, namespace, "Ready", log_path)
                assert ready["status"]["canary"]["verdict"] == "Passed"
                assert ready["status"]["outOfTraffic"] == []

                async def back_in_traffic() -> bool:
                    # The label follows the status write (a failed write never changes a label).
                    return await traffic_label(kube, namespace, replica) == TRAFFIC_ON

                await eventually(back_in_traffic, what=f"{replica} labelled traffic=on")
                assert await kube.get_or_none("v1", "ConfigMap", config_map_name(SERVING), namespace)

            # No finalizer: the API server deletes it, the garbage collector the children.
            await kube.delete(API_VERSION, KIND, SERVING, namespace)
            await wait_until_deleted(kube, namespace, log_path)
    log = operator_log(log_path)
    assert re.search(r"HTTP/1\.1 20[01] ", log), "no API request lines in the log: is --debug honoured?"
    # httpx logs "HTTP/1.1 403 Forbidden", the operator's errors say "HTTP 403", kopf's "Forbidden" or
    # "Not enough permissions".
    refusals = re.findall(
        r".*(?:HTTP(?:/1\.1)? 403|forbidden|not enough permissions).*", log, flags=re.IGNORECASE
    )
    assert not refusals, f"refused at work: {refusals}"

    with kube_cluster.client(token=token) as as_operator:
        allowed = []
        for method, path, body in forbidden_requests(installed):
            response = as_operator.request(method, path, json=body)
            if response.status_code != 403:
                allowed.append(f"{method} {path}: HTTP {response.status_code}")
    assert not allowed, f"the chart's ServiceAccount may do more than it needs: {allowed}"
