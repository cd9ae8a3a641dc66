"""Cluster tier: a real etcd + kube-apiserver + kube-controller-manager on 127.0.0.1.

One control plane per test session (`kube_cluster`); each test gets a fresh namespace
(`namespace`) and an async API client with admin rights (`kube`). An operator test asks for `operator`:
the CRD installed, two fake replicas (`fakes`) and the operator running in-process with `settings` (its
test's namespace watched, resource `demo`'s replicas mapped to the fakes). Every test under tests/cluster
is marked `cluster`. A test's captured output lists the CPU stalls of this machine while it ran (no rerun:
that is the e2e tier's alone), so a failure beside the e2e tier in CI says whether one fell inside it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from tests.cluster.operator_harness import RunningOperator, install_crd, operator_settings, run_operator
from tests.support.apiserver import ControlPlane, start_control_plane
from tests.support.cpu_stalls import cpu_stall_monitor, cpu_stall_watch  # noqa: F401 (fixtures)
from tests.support.fake_vllm import FakeCluster

from mooncake_operator.kube.client import KubeClient
from mooncake_operator.kube.config import KubeConfig
from mooncake_operator.kube.kinds import SERVING_KIND
from mooncake_operator.runtime.settings import OperatorSettings

CLUSTER_DIR = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if CLUSTER_DIR in item.path.parents:
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def kube_cluster() -> Iterator[ControlPlane]:
    plane = start_control_plane()
    try:
        yield plane
    finally:
        plane.stop()


def admin_config(plane: ControlPlane) -> KubeConfig:
    return KubeConfig(server=plane.server, token=plane.admin_token, ca_path=plane.ca_path)


def wait_for_default_service_account(plane: ControlPlane, namespace: str, timeout: float = 30.0) -> None:
    """Pods are admitted only once the namespace's `default` ServiceAccount has its token Secret."""
    deadline = time.monotonic() + timeout
    with plane.client() as http:
        while time.monotonic() < deadline:
            response = http.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/default")
            if response.status_code == 200 and response.json().get("secrets"):
                return
            time.sleep(0.1)
    raise AssertionError(
        f"{namespace}: no `default` ServiceAccount token after {timeout}s (controller-manager down?)"
    )


@pytest.fixture
def namespace(kube_cluster: ControlPlane) -> Iterator[str]:
    """A namespace of its own for one test; deleted afterwards (the namespace controller empties it)."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    with kube_cluster.client() as http:
        created = http.post(
            "/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
        )
        assert created.status_code == 201, created.text
    wait_for_default_service_account(kube_cluster, name)
    yield name
    with kube_cluster.client() as http:
        deleted = http.delete(f"/api/v1/namespaces/{name}")
        assert deleted.status_code in (200, 202, 404), deleted.text


@pytest.fixture
async def kube(kube_cluster: ControlPlane) -> AsyncIterator[KubeClient]:
    async with KubeClient(admin_config(kube_cluster), kinds=[SERVING_KIND]) as client:
        yield client


@pytest.fixture
async def crd(kube: KubeClient) -> AsyncIterator[None]:
    """The MooncakeServing CRD installed (and Established) for an operator test."""
    await install_crd(kube)
    yield


@pytest.fixture
def fakes() -> Iterator[FakeCluster]:
    """Three loopback fake vLLM replicas sharing a fake store: ordinals 0 and 1 for spec.replicas 2, and 2
    for an InPlace rollout's surge replica (spec.rollout.maxSurge)."""
    with FakeCluster.start(3) as cluster:
        yield cluster


@pytest.fixture
def settings(kube_cluster: ControlPlane, namespace: str, fakes: FakeCluster) -> OperatorSettings:
    """The operator's settings for one test: its namespace watched, resource `demo`'s replicas mapped to
    `fakes` (`dataclasses.replace` it for more)."""
    endpoints = {f"{namespace}/demo": tuple(fakes.urls)}
    return operator_settings(kube_cluster, namespace, replica_endpoints=endpoints)


@pytest.fixture
def operator(crd: None, settings: OperatorSettings) -> Iterator[RunningOperator]:
    """The operator running with `settings`, the CRD installed; stopped after the test."""
    with run_operator(settings) as running:
        yield running
