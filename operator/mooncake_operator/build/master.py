"""The Mooncake master: one Deployment and its Service, or, with highly available masters, a
StatefulSet and its headless Service (the operator asks each master's /health which one leads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.api.spec import MooncakeServingSpec
from mooncake_operator.api.store import MasterSpec
from mooncake_operator.build.engine_args import master_argv
from mooncake_operator.build.etcd import (
    etcd_ca_mounts,
    etcd_ca_volumes,
    etcd_service,
    etcd_stateful_set,
    ha_enabled,
    ha_topology,
)
from mooncake_operator.build.names import (
    COMPONENT_MASTER,
    HEALTH_PATH,
    MASTER_CONTAINER,
    METRICS_PORT_NAME,
    RPC_PORT_NAME,
    ChildNames,
    HaNames,
    Manifest,
    labels,
    object_meta,
    selector,
)
from mooncake_operator.build.pods import (
    container_resources,
    extra_pod_labels,
    pod_hardening,
    scheduling_fields,
    with_spread,
)


def _master_service_ports(master: MasterSpec) -> list[dict[str, Any]]:
    """The master's RPC and metrics ports, as both the ClusterIP and the HA headless Service expose them."""
    return [
        {"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
        for name, port in ((RPC_PORT_NAME, master.rpc_port), (METRICS_PORT_NAME, master.metrics_port))
    ]


def master_service(resource: MooncakeServing, *, owner_uid: str | None) -> Manifest:
    names = ChildNames.of(resource.metadata.name)
    master = resource.spec.store.master
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(
            resource, names.master, labels(resource, "mooncake-master", COMPONENT_MASTER), owner_uid
        ),
        "spec": {
            "type": "ClusterIP",
            "selector": selector(resource, COMPONENT_MASTER),
            "ports": _master_service_ports(master),
        },
    }


def master_deployment(resource: MooncakeServing, *, owner_uid: str | None) -> Manifest:
    names = ChildNames.of(resource.metadata.name)
    spec = resource.spec
    master = spec.store.master
    pod_labels = labels(resource, "mooncake-master", COMPONENT_MASTER)
    container: dict[str, Any] = {
        "name": MASTER_CONTAINER,
        "image": master.image or spec.engine.image,
        "command": list(master_argv(spec)),
        "ports": [
            {"name": RPC_PORT_NAME, "containerPort": master.rpc_port, "protocol": "TCP"},
            {"name": METRICS_PORT_NAME, "containerPort": master.metrics_port, "protocol": "TCP"},
        ],
        "readinessProbe": {"tcpSocket": {"port": RPC_PORT_NAME}, "periodSeconds": 5, "failureThreshold": 3},
        # mooncake_master answers /health on its metrics port.
        "livenessProbe": {
            "httpGet": {"path": HEALTH_PATH, "port": METRICS_PORT_NAME},
            "initialDelaySeconds": 10,
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
    }
    resources = container_resources(master.resources)
    if resources:
        container["resources"] = resources
    # It needs no GPU; in a CUDA image the NVIDIA runtime would otherwise expose every GPU of the node.
    container["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    container["securityContext"] = master_security_context()
    pod_spec: dict[str, Any] = {**pod_hardening(spec), **master_placement(spec), "containers": [container]}
    template_metadata = master_template_metadata(spec, pod_labels)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(resource, names.master, pod_labels, owner_uid),
        "spec": {
            "replicas": 1,
            # Two masters would split the store's metadata; the old one must be gone first.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector(resource, COMPONENT_MASTER)},
            "template": {"metadata": template_metadata, "spec": pod_spec},
        },
    }


def master_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": MASTER_USER_ID,
        "runAsGroup": MASTER_USER_ID,
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def master_template_metadata(spec: MooncakeServingSpec, pod_labels: dict[str, str]) -> dict[str, Any]:
    template_metadata: dict[str, Any] = {"labels": {**extra_pod_labels(spec), **pod_labels}}
    annotations = dict(spec.pod_metadata.annotations or {}) if spec.pod_metadata is not None else {}
    if annotations:
        template_metadata["annotations"] = annotations
    return template_metadata


# The master needs no privileges: measured with the real mooncake_master (bench/RESULTS.md).
MASTER_USER_ID = 65532


def master_placement(spec: MooncakeServingSpec) -> dict[str, Any]:
    scheduling = spec.store.master.scheduling
    out = scheduling_fields(scheduling)
    if scheduling is not None and scheduling.affinity is not None:
        out["affinity"] = scheduling.affinity.to_wire()
    return out


def masters_headless_service(resource: MooncakeServing, *, owner_uid: str | None) -> Manifest:
    master = resource.spec.store.master
    ha_names = HaNames.of(resource.metadata.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(
            resource,
            ha_names.masters_headless,
            labels(resource, "mooncake-master", COMPONENT_MASTER),
            owner_uid,
        ),
        "spec": {
            "clusterIP": "None",
            # Standbys are addressable too: the operator asks every master which one leads.
            "publishNotReadyAddresses": True,
            "selector": selector(resource, COMPONENT_MASTER),
            "ports": _master_service_ports(master),
        },
    }


def master_stateful_set(resource: MooncakeServing, *, owner_uid: str | None) -> Manifest:
    names, ha_names = ChildNames.of(resource.metadata.name), HaNames.of(resource.metadata.name)
    spec = resource.spec
    master = spec.store.master
    ha = ha_topology(resource)
    assert ha is not None, "master_stateful_set renders highly available masters only"
    pod_labels = labels(resource, "mooncake-master", COMPONENT_MASTER)
    # The leader publishes its -rpc_address to the clients: the pod IP (Kubernetes expands $(POD_IP)).
    argv = master_argv(spec, rpc_address="$(POD_IP)", ha=ha)
    health = {"httpGet": {"path": HEALTH_PATH, "port": METRICS_PORT_NAME}, "timeoutSeconds": 5}
    container: dict[str, Any] = {
        "name": MASTER_CONTAINER,
        "image": master.image or spec.engine.image,
        "command": list(argv),
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            # It needs no GPU; in a CUDA image the NVIDIA runtime would otherwise expose every GPU.
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"},
            *(
                {"name": key, "value": value}
                for key, value in ha.client_env().items()
                if key == "SSL_CERT_DIR"
            ),
        ],
        "ports": [
            {"name": RPC_PORT_NAME, "containerPort": master.rpc_port, "protocol": "TCP"},
            {"name": METRICS_PORT_NAME, "containerPort": master.metrics_port, "protocol": "TCP"},
        ],
        # A standby answers /health with 200 too (role "standby"): Ready means "running and in the
        # election", so a rolling update never waits for a standby to lead.
        "readinessProbe": {**health, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**health, "initialDelaySeconds": 10, "periodSeconds": 10, "failureThreshold": 6},
    }
    mounts = etcd_ca_mounts(resource)
    if mounts:
        container["volumeMounts"] = mounts
    resources = container_resources(master.resources)
    if resources:
        container["resources"] = resources
    container["securityContext"] = master_security_context()
    placement = master_placement(spec)
    pod_spec: dict[str, Any] = {
        **pod_hardening(spec),
        **placement,
        "affinity": with_spread(placement.get("affinity"), resource, COMPONENT_MASTER),
        "containers": [container],
    }
    volumes = etcd_ca_volumes(resource)
    if volumes:
        pod_spec["volumes"] = volumes
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": object_meta(resource, names.master, pod_labels, owner_uid),
        "spec": {
            "serviceName": ha_names.masters_headless,
            "replicas": master.high_availability.replicas,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": selector(resource, COMPONENT_MASTER)},
            "template": {"metadata": master_template_metadata(spec, pod_labels), "spec": pod_spec},
        },
    }


@dataclass(frozen=True)
class ChildRef:
    api_version: str
    kind: str
    name: str


def retired_workloads(resource: MooncakeServing) -> list[ChildRef]:
    """Workloads of the other master mode (or of an etcd no longer operator-run). The operator scales them
    to zero when found (it holds no delete permission); the garbage collector removes them with the
    resource. Their Services stay too: nothing uses them (clients follow etcd or the master Service)."""
    names, ha_names = ChildNames.of(resource.metadata.name), HaNames.of(resource.metadata.name)
    etcd = ChildRef("apps/v1", "StatefulSet", ha_names.etcd)
    if not ha_enabled(resource):
        return [ChildRef("apps/v1", "StatefulSet", names.master), etcd]
    retired = [ChildRef("apps/v1", "Deployment", names.master)]
    if resource.spec.store.master.high_availability.etcd.managed_or_default() is None:
        retired.append(etcd)
    return retired


def master_children(resource: MooncakeServing, *, owner_uid: str | None) -> list[Manifest]:
    if not ha_enabled(resource):
        return [
            master_service(resource, owner_uid=owner_uid),
            master_deployment(resource, owner_uid=owner_uid),
        ]
    children: list[Manifest] = []
    if resource.spec.store.master.high_availability.etcd.managed_or_default() is not None:
        children += [
            etcd_service(resource, owner_uid=owner_uid),
            etcd_stateful_set(resource, owner_uid=owner_uid),
        ]
    return [
        *children,
        masters_headless_service(resource, owner_uid=owner_uid),
        master_stateful_set(resource, owner_uid=owner_uid),
    ]
