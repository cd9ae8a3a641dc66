"""The control-plane harness itself: real TLS, token auth, RBAC, garbage collection, loopback only."""

from __future__ import annotations

import re
import ssl
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from tests.support.apiserver import (
    KUBE_VERSION,
    ControlPlane,
    ControlPlaneError,
    find_binaries,
    start_control_plane,
)


def poll(predicate: Callable[[], bool], timeout: float = 30.0, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def test_server_reports_its_version_over_verified_tls(kube_cluster: ControlPlane) -> None:
    with kube_cluster.client() as http:
        version = http.get("/version").json()
    assert version["gitVersion"] == f"v{KUBE_VERSION}"
    assert kube_cluster.server.startswith("https://127.0.0.1:")


def test_requests_without_a_valid_token_are_refused(kube_cluster: ControlPlane) -> None:
    with kube_cluster.client(token="not-a-token") as http:
        assert http.get("/api/v1/namespaces").status_code == 401


def test_admin_kubeconfig_points_at_the_server(kube_cluster: ControlPlane) -> None:
    text = kube_cluster.kubeconfig.read_text()
    for expected in (kube_cluster.server, kube_cluster.admin_token, str(kube_cluster.ca_path)):
        assert expected in text


def _create(http: httpx.Client, path: str, body: dict[str, object]) -> dict[str, object]:
    response = http.post(path, json=body)
    assert response.status_code == 201, response.text
    created: dict[str, object] = response.json()
    return created


def test_rbac_is_enforced_for_service_account_tokens(kube_cluster: ControlPlane, namespace: str) -> None:
    with kube_cluster.client() as admin:
        _create(
            admin,
            f"/api/v1/namespaces/{namespace}/serviceaccounts",
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader"}},
        )
    token = kube_cluster.service_account_token(namespace, "reader")
    pods = f"/api/v1/namespaces/{namespace}/pods"
    with kube_cluster.client(token=token) as reader:
        assert reader.get(pods).status_code == 403
        with kube_cluster.client() as admin:
            rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}"
            _create(
                admin,
                f"{rbac}/roles",
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "Role",
                    "metadata": {"name": "pod-reader"},
                    "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
                },
            )
            _create(
                admin,
                f"{rbac}/rolebindings",
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "RoleBinding",
                    "metadata": {"name": "reader"},
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "Role",
                        "name": "pod-reader",
                    },
                    "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
                },
            )
        # The authorizer reads RBAC objects from an informer cache: allow it to catch up.
        assert poll(lambda: reader.get(pods).status_code == 200)
        assert reader.get(f"/api/v1/namespaces/{namespace}/secrets").status_code == 403


def test_garbage_collector_deletes_owned_objects(kube_cluster: ControlPlane, namespace: str) -> None:
    configmaps = f"/api/v1/namespaces/{namespace}/configmaps"
    with kube_cluster.client() as http:
        owner = _create(
            http, configmaps, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}}
        )
        owner_uid = owner["metadata"]["uid"]  # type: ignore[index]
        reference = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}
        _create(
            http,
            configmaps,
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "child", "ownerReferences": [reference]},
            },
        )
        assert http.delete(f"{configmaps}/owner").status_code == 200
        assert poll(lambda: http.get(f"{configmaps}/child").status_code == 404), "child outlived its owner"


def _listening_addresses(pids: set[int]) -> list[tuple[str, int]]:
    """(local address, pid) of every TCP listener owned by one of `pids`, from `ss`."""
    output = subprocess.run(["ss", "-H", "-ltnp"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in output.splitlines():
        fields = line.split()
        owners = {int(pid) for pid in re.findall(r"pid=(\d+)", line)}
        for pid in owners & pids:
            found.append((fields[3].rsplit(":", 1)[0], pid))
    return found


def test_every_component_listens_on_loopback_only(kube_cluster: ControlPlane) -> None:
    pids = {process.pid for process in kube_cluster.processes.values()}
    assert set(kube_cluster.processes) == {"etcd", "kube-apiserver", "kube-controller-manager"}
    listeners = _listening_addresses(pids)
    assert listeners, "found no listening sockets for the control plane's processes"
    assert {address for address, _ in listeners} == {"127.0.0.1"}, listeners
    # The controller-manager serves nothing (both its ports are off).
    assert kube_cluster.processes["kube-controller-manager"].pid not in {pid for _, pid in listeners}


def test_stop_terminates_what_it_started_and_removes_its_files() -> None:
    started = time.monotonic()
    plane = start_control_plane(controller_manager=False)
    elapsed = time.monotonic() - started
    processes = list(plane.processes.values())
    with plane.client() as http:
        assert http.get("/readyz").status_code == 200
    plane.stop()
    assert all(process.poll() is not None for process in processes)
    assert not plane.workdir.exists()
    plane.stop()  # idempotent
    print(f"etcd + kube-apiserver ready in {elapsed:.1f}s")


def test_missing_binaries_fail_with_the_command_that_builds_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MOONCAKE_OPERATOR_CACHE", str(tmp_path))
    with pytest.raises(ControlPlaneError, match="run scripts/build-kube"):
        find_binaries()
    with pytest.raises(ControlPlaneError, match="run scripts/build-kube"):
        start_control_plane()


def test_client_certificates_signed_by_the_cluster_ca_authenticate(kube_cluster: ControlPlane) -> None:
    cert, key = kube_cluster.issue_client_certificate("cert-user", groups=["system:masters"])
    context = ssl.create_default_context(cafile=kube_cluster.ca_path)
    context.load_cert_chain(cert, key)
    with httpx.Client(base_url=kube_cluster.server, verify=context) as http:
        assert http.get("/api/v1/namespaces").status_code == 200
