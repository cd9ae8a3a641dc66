"""mooncake_operator.kube against a real kube-apiserver: apply, reads, patches, events, errors, config."""

from __future__ import annotations

import asyncio
import base64
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.support.apiserver import ControlPlane, free_port

from mooncake_operator.kube.client import KubeClient
from mooncake_operator.kube.config import KubeConfig
from mooncake_operator.kube.errors import KubeApiError, KubeConfigError, KubeTransportError
from mooncake_operator.kube.kinds import ResourceKind, resource_path

MANAGER = "mooncake-operator-test"


def config_map(
    name: str, namespace: str, data: dict[str, str], labels: dict[str, str] | None = None
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if labels:
        metadata["labels"] = labels
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}


def deployment(name: str, namespace: str) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "main", "image": "registry.invalid/none:1"}]},
            },
        },
    }


async def test_apply_creates_then_an_identical_apply_changes_nothing(
    kube: KubeClient, namespace: str
) -> None:
    desired = config_map("settings", namespace, {"a": "1"})
    created = await kube.apply(desired, field_manager=MANAGER)
    again = await kube.apply(desired, field_manager=MANAGER)
    assert created["data"] == {"a": "1"}
    assert again["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
    stored = await kube.get("v1", "ConfigMap", "settings", namespace)
    assert stored["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
    assert [entry["manager"] for entry in stored["metadata"]["managedFields"]] == [MANAGER]


async def test_apply_with_a_change_updates_and_drops_fields_it_no_longer_sets(
    kube: KubeClient, namespace: str
) -> None:
    first = await kube.apply(config_map("settings", namespace, {"a": "1", "b": "2"}), field_manager=MANAGER)
    second = await kube.apply(config_map("settings", namespace, {"a": "3"}), field_manager=MANAGER)
    assert second["data"] == {"a": "3"}
    assert second["metadata"]["resourceVersion"] != first["metadata"]["resourceVersion"]


async def test_dry_run_writes_nothing(kube: KubeClient, namespace: str) -> None:
    before = kube.counts.snapshot()
    answer = await kube.apply(config_map("dry", namespace, {"a": "1"}), field_manager=MANAGER, dry_run=True)
    assert answer["data"] == {"a": "1"}
    created = await kube.create(config_map("dry-create", namespace, {"a": "1"}), dry_run=True)
    assert created["metadata"]["name"] == "dry-create"
    assert await kube.get_or_none("v1", "ConfigMap", "dry", namespace) is None
    assert await kube.get_or_none("v1", "ConfigMap", "dry-create", namespace) is None
    delta = kube.counts.since(before)
    assert (delta.writes, delta.dry_runs, delta.reads) == (0, 2, 2)


async def test_dry_run_still_validates(kube: KubeClient, namespace: str) -> None:
    with pytest.raises(KubeApiError) as raised:
        await kube.create(config_map("Not_A_Valid_Name", namespace, {}), dry_run=True)
    assert raised.value.status == 422


async def test_missing_object_is_a_typed_404(kube: KubeClient, namespace: str) -> None:
    with pytest.raises(KubeApiError) as raised:
        await kube.get("v1", "ConfigMap", "absent", namespace)
    error = raised.value
    assert (error.status, error.reason, error.not_found) == (404, "NotFound", True)
    assert error.message == 'configmaps "absent" not found'


async def test_invalid_object_is_a_typed_422_with_the_servers_message(
    kube: KubeClient, namespace: str
) -> None:
    with pytest.raises(KubeApiError) as raised:
        await kube.apply(config_map("Not_A_Valid_Name", namespace, {}), field_manager=MANAGER)
    error = raised.value
    assert (error.status, error.reason) == (422, "Invalid")
    assert "Not_A_Valid_Name" in error.message and "RFC 1123" in error.message
    assert error.details.get("name") == "Not_A_Valid_Name"


async def test_creating_an_existing_object_is_a_conflict(kube: KubeClient, namespace: str) -> None:
    await kube.create(config_map("once", namespace, {}))
    with pytest.raises(KubeApiError) as raised:
        await kube.create(config_map("once", namespace, {}))
    assert (raised.value.status, raised.value.reason, raised.value.conflict) == (409, "AlreadyExists", True)


async def test_list_by_label_selector(kube: KubeClient, namespace: str) -> None:
    for name, labels in [("one", {"tier": "a"}), ("two", {"tier": "a"}), ("three", {"tier": "b"})]:
        await kube.apply(config_map(name, namespace, {}, labels), field_manager=MANAGER)
    selected = await kube.list("v1", "ConfigMap", namespace, label_selector="tier=a")
    assert sorted(item["metadata"]["name"] for item in selected) == ["one", "two"]
    assert {(item["apiVersion"], item["kind"]) for item in selected} == {("v1", "ConfigMap")}
    everything = await kube.list("v1", "ConfigMap", namespace, label_selector="tier")
    assert len(everything) == 3


async def test_patch_merge_sets_and_removes_pod_labels(kube: KubeClient, namespace: str) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "replica-0", "namespace": namespace, "labels": {"app": "x", "serving": "true"}},
        "spec": {"containers": [{"name": "main", "image": "registry.invalid/none:1"}]},
    }
    await kube.create(pod)
    patched = await kube.patch_merge(
        "v1", "Pod", "replica-0", {"metadata": {"labels": {"serving": None, "held": "true"}}}, namespace
    )
    assert patched["metadata"]["labels"] == {"app": "x", "held": "true"}


async def test_patch_status_writes_only_the_status(kube: KubeClient, namespace: str) -> None:
    created = await kube.apply(deployment("master", namespace), field_manager=MANAGER)
    patched = await kube.patch_status(
        "apps/v1",
        "Deployment",
        "master",
        {"replicas": 1, "readyReplicas": 1},
        namespace,
        field_manager=MANAGER,
    )
    assert patched["status"]["readyReplicas"] == 1
    assert patched["spec"] == created["spec"]
    assert patched["metadata"]["generation"] == created["metadata"]["generation"]


async def test_create_event_refers_to_the_object(kube: KubeClient, namespace: str) -> None:
    owner = await kube.apply(config_map("subject", namespace, {}), field_manager=MANAGER)
    event = await kube.create_event(owner, reason="CanaryPassed", message="warm == cold", type="Warning")
    assert event["metadata"]["name"].startswith("subject.")
    found = await kube.list("v1", "Event", namespace, field_selector="involvedObject.name=subject")
    assert len(found) == 1
    stored = found[0]
    assert stored["involvedObject"]["uid"] == owner["metadata"]["uid"]
    assert (stored["reason"], stored["message"], stored["type"]) == (
        "CanaryPassed",
        "warm == cold",
        "Warning",
    )
    assert stored["source"]["component"] == "mooncake-operator"


async def test_delete_and_missing_ok(kube: KubeClient, namespace: str) -> None:
    await kube.apply(config_map("doomed", namespace, {}), field_manager=MANAGER)
    await kube.delete("v1", "ConfigMap", "doomed", namespace)
    assert await kube.get_or_none("v1", "ConfigMap", "doomed", namespace) is None
    await kube.delete("v1", "ConfigMap", "doomed", namespace, missing_ok=True)
    with pytest.raises(KubeApiError) as raised:
        await kube.delete("v1", "ConfigMap", "doomed", namespace)
    assert raised.value.not_found


async def test_cluster_scoped_kinds(kube: KubeClient, namespace: str) -> None:
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": f"{namespace}-reader"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}],
    }
    applied = await kube.apply(role, field_manager=MANAGER)
    assert "namespace" not in applied["metadata"]
    await kube.delete("rbac.authorization.k8s.io/v1", "ClusterRole", role["metadata"]["name"])


async def test_requests_are_counted_by_verb(kube: KubeClient, namespace: str) -> None:
    before = kube.counts.snapshot()
    await kube.apply(config_map("counted", namespace, {}), field_manager=MANAGER)
    await kube.get("v1", "ConfigMap", "counted", namespace)
    await kube.list("v1", "ConfigMap", namespace)
    await kube.patch_merge("v1", "ConfigMap", "counted", {"data": {"k": "v"}}, namespace)
    await kube.delete("v1", "ConfigMap", "counted", namespace)
    delta = kube.counts.since(before)
    assert dict(delta.by_verb) == {"apply": 1, "get": 1, "list": 1, "patch": 1, "delete": 1}
    assert (delta.reads, delta.writes) == (2, 3)


async def test_concurrent_requests_share_one_client(kube: KubeClient, namespace: str) -> None:
    names = [f"c{i}" for i in range(10)]
    await asyncio.gather(*(kube.apply(config_map(n, namespace, {}), field_manager=MANAGER) for n in names))
    listed = await kube.list("v1", "ConfigMap", namespace)
    assert {n for n in names} <= {item["metadata"]["name"] for item in listed}


# --------------------------------------------------------------------------- configuration sources


async def test_config_from_the_harness_kubeconfig(kube_cluster: ControlPlane) -> None:
    config = KubeConfig.from_kubeconfig(kube_cluster.kubeconfig)
    assert config.server == kube_cluster.server
    async with KubeClient(config) as client:
        namespaces = await client.list("v1", "Namespace")
    assert "default" in {item["metadata"]["name"] for item in namespaces}


async def test_config_from_a_kubeconfig_with_embedded_client_certificate(
    kube_cluster: ControlPlane, tmp_path: Path
) -> None:
    cert, key = kube_cluster.issue_client_certificate("cert-admin", groups=["system:masters"])

    def b64(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()

    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "c",
                "cluster": {
                    "server": kube_cluster.server,
                    "certificate-authority-data": b64(kube_cluster.ca_path),
                },
            }
        ],
        "users": [{"name": "u", "user": {"client-certificate-data": b64(cert), "client-key-data": b64(key)}}],
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u", "namespace": "default"}}],
        "current-context": "ctx",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(document))
    config = KubeConfig.from_kubeconfig(path)
    assert config.namespace == "default" and config.token is None
    async with KubeClient(config) as client:
        assert (await client.get("v1", "Namespace", "default"))["metadata"]["name"] == "default"


async def test_in_cluster_config_rereads_a_rotated_token(kube_cluster: ControlPlane, tmp_path: Path) -> None:
    shutil.copy(kube_cluster.ca_path, tmp_path / "ca.crt")
    (tmp_path / "token").write_text(kube_cluster.admin_token + "\n")
    (tmp_path / "namespace").write_text("default")
    host, port = kube_cluster.server.removeprefix("https://").rsplit(":", 1)
    environ = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}
    config = KubeConfig.in_cluster(tmp_path, environ)
    assert (config.server, config.namespace) == (kube_cluster.server, "default")
    async with KubeClient(config) as client:
        await client.get("v1", "Namespace", "default")
        (tmp_path / "token").write_text("rotated-but-wrong")
        with pytest.raises(KubeApiError) as raised:
            await client.get("v1", "Namespace", "default")
    assert raised.value.status == 401


async def test_kubeconfig_token_file_relative_to_the_kubeconfig(
    kube_cluster: ControlPlane, tmp_path: Path
) -> None:
    (tmp_path / "token").write_text(kube_cluster.admin_token)
    document = {
        "clusters": [
            {
                "name": "c",
                "cluster": {
                    "server": kube_cluster.server,
                    "certificate-authority": str(kube_cluster.ca_path),
                },
            }
        ],
        "users": [{"name": "u", "user": {"tokenFile": "token"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(document))
    config = KubeConfig.from_kubeconfig(tmp_path / "kubeconfig")
    assert config.token_path == tmp_path / "token"
    async with KubeClient(config) as client:
        await client.get("v1", "Namespace", "default")


def test_config_repr_never_shows_credentials() -> None:
    config = KubeConfig(server="https://127.0.0.1:1", token="s3cret", client_key_data=b"KEY")
    assert "s3cret" not in repr(config) and "KEY" not in repr(config)


def test_in_cluster_config_outside_a_cluster_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(KubeConfigError, match="KUBERNETES_SERVICE_HOST"):
        KubeConfig.in_cluster(tmp_path, {})
    with pytest.raises(KubeConfigError, match="token is missing"):
        KubeConfig.in_cluster(
            tmp_path, {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "1"}
        )


def test_kubeconfig_with_basic_auth_is_refused_clearly(tmp_path: Path) -> None:
    document = {
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"username": "admin", "password": "x"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(KubeConfigError, match=r"\['username'\] \(basic auth\) is not supported"):
        KubeConfig.from_kubeconfig(path)
    with pytest.raises(KubeConfigError, match="no context named 'other'"):
        KubeConfig.from_kubeconfig(path, context="other")
    with pytest.raises(KubeConfigError, match="not found"):
        KubeConfig.from_kubeconfig(tmp_path / "absent")


async def test_unreachable_server_is_a_transport_error() -> None:
    config = KubeConfig(server=f"https://127.0.0.1:{free_port()}", token="t", insecure_skip_tls_verify=True)
    async with KubeClient(config, timeout=2.0) as client:
        with pytest.raises(KubeTransportError):
            await client.get("v1", "Namespace", "default")


def test_resource_paths_and_unknown_kinds() -> None:
    deployments = ResourceKind("apps/v1", "Deployment", "deployments", namespaced=True)
    assert resource_path(deployments, namespace="ns", name="d") == "/apis/apps/v1/namespaces/ns/deployments/d"
    pods = ResourceKind("v1", "Pod", "pods", namespaced=True)
    assert (
        resource_path(pods, namespace="ns", name="p", subresource="status")
        == "/api/v1/namespaces/ns/pods/p/status"
    )
    with pytest.raises(ValueError, match="namespace is required"):
        resource_path(pods, name="p")
    namespaces = ResourceKind("v1", "Namespace", "namespaces", namespaced=False)
    with pytest.raises(ValueError, match="cluster-scoped"):
        resource_path(namespaces, namespace="ns")
    client = KubeClient(KubeConfig(server="https://127.0.0.1:1"))
    with pytest.raises(ValueError, match="unknown kind v1/Widget"):
        client.kind("v1", "Widget")
