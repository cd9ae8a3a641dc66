"""Highly available masters' election backend: the topology the store clients and masters are
given (etcd endpoints, cluster id, TLS), the etcd CA volume, and the operator-run etcd (a StatefulSet
with a volume per member, and its headless Service).
"""

from __future__ import annotations

from typing import Any

from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.build.engine_args import ETCD_CA_DIR, HaTopology
from mooncake_operator.build.names import COMPONENT_ETCD, HaNames, Manifest, labels, object_meta, selector
from mooncake_operator.build.pods import container_resources, pod_hardening, with_spread

# With store.master.highAvailability.enabled the single master Deployment and its Service give way to:
#
#   Service      NAME-masters   headless: NAME-master-<i>.NAME-masters.NS.svc (the operator asks each
#                               master's /health which one leads)
#   StatefulSet  NAME-master    N mooncake_master, leader election through etcd, -rpc_address = pod IP
#                               (the leader publishes it; clients connect to it)
#   Service      NAME-etcd      headless, only with the operator-run etcd
#   StatefulSet  NAME-etcd      the operator-run etcd, a PersistentVolumeClaim per member
#
# The store config's master address becomes etcd://<endpoints>: clients follow the leader themselves.

ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
ETCD_CONTAINER = "etcd"
ETCD_DATA_DIR = "/var/lib/etcd"
ETCD_CA_VOLUME = "etcd-ca"
# etcd runs as this non-root user (the distroless "nonroot" id); the members' claims are group-owned by it
# (fsGroup), so the data directory etcd creates in them is its own. Pod Security "restricted" throughout.
ETCD_USER_ID = 65532
# Without user-set resources: what a 1-5 member etcd holding only leader election (and the oplog) needs;
# the memory limit keeps a runaway member from taking the node's memory from the engines.
DEFAULT_ETCD_RESOURCES: dict[str, dict[str, str | int]] = {
    "requests": {"cpu": "100m", "memory": "256Mi"},
    "limits": {"memory": "1Gi"},
}


def ha_enabled(resource: MooncakeServing) -> bool:
    return resource.spec.store.master.high_availability.enabled


def ha_cluster_id(resource: MooncakeServing) -> str:
    """The Mooncake cluster id: one per resource, so resources sharing an etcd never share a leader."""
    return f"mooncake-operator.{resource.metadata.namespace}.{resource.metadata.name}"


def managed_etcd_endpoints(resource: MooncakeServing) -> list[str]:
    etcd = resource.spec.store.master.high_availability.etcd.managed_or_default()
    members = etcd.replicas if etcd is not None else 0
    names = HaNames.of(resource.metadata.name)
    namespace = resource.metadata.namespace
    return [f"{names.etcd}-{i}.{names.etcd}.{namespace}.svc:{ETCD_CLIENT_PORT}" for i in range(members)]


def ha_topology(resource: MooncakeServing) -> HaTopology | None:
    ha = resource.spec.store.master.high_availability
    if not ha.enabled:
        return None
    external = ha.etcd.external
    endpoints = external.endpoints if external is not None else managed_etcd_endpoints(resource)
    return HaTopology(
        etcd_endpoints=tuple(endpoints),
        cluster_id=ha_cluster_id(resource),
        tls=external is not None and external.tls is not None,
        enable_oplog=ha.enable_oplog,
    )


def etcd_ca_volumes(resource: MooncakeServing) -> list[dict[str, Any]]:
    """The etcd CA Secret as a volume (HA with a TLS etcd only)."""
    ha = resource.spec.store.master.high_availability
    external = ha.etcd.external
    if not ha.enabled or external is None or external.tls is None:
        return []
    ref = external.tls.ca_secret_ref
    return [
        {
            "name": ETCD_CA_VOLUME,
            "secret": {"secretName": ref.name, "items": [{"key": ref.key, "path": "ca.crt"}]},
        }
    ]


def etcd_ca_mounts(resource: MooncakeServing) -> list[dict[str, Any]]:
    if not etcd_ca_volumes(resource):
        return []
    return [{"name": ETCD_CA_VOLUME, "mountPath": ETCD_CA_DIR, "readOnly": True}]


def etcd_service(resource: MooncakeServing, *, owner_uid: str | None) -> Manifest:
    ha_names = HaNames.of(resource.metadata.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(resource, ha_names.etcd, labels(resource, "etcd", COMPONENT_ETCD), owner_uid),
        "spec": {
            "clusterIP": "None",
            # Members must resolve each other before they are Ready, or the cluster never forms.
            "publishNotReadyAddresses": True,
            "selector": selector(resource, COMPONENT_ETCD),
            "ports": [
                {"name": "client", "port": ETCD_CLIENT_PORT, "targetPort": "client", "protocol": "TCP"},
                {"name": "peer", "port": ETCD_PEER_PORT, "targetPort": "peer", "protocol": "TCP"},
            ],
        },
    }


def etcd_pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": ETCD_USER_ID,
        "runAsGroup": ETCD_USER_ID,
        # The claim's root directory becomes group-writable by etcd's group; checked once per mount.
        "fsGroup": ETCD_USER_ID,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def etcd_container_security_context() -> dict[str, Any]:
    # etcd writes only to its data directory (the claim): the root filesystem can be read-only.
    return {
        "runAsNonRoot": True,
        "runAsUser": ETCD_USER_ID,
        "runAsGroup": ETCD_USER_ID,
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def etcd_stateful_set(resource: MooncakeServing, *, owner_uid: str | None) -> Manifest:
    etcd = resource.spec.store.master.high_availability.etcd.managed_or_default()
    assert etcd is not None, "etcd_stateful_set renders the operator-run etcd only"
    ha_names = HaNames.of(resource.metadata.name)
    namespace = resource.metadata.namespace
    peer = f"$(POD_NAME).{ha_names.etcd}.{namespace}.svc"
    members = ",".join(
        f"{ha_names.etcd}-{i}=http://{ha_names.etcd}-{i}.{ha_names.etcd}.{namespace}.svc:{ETCD_PEER_PORT}"
        for i in range(etcd.replicas)
    )
    command = [
        "etcd",
        "--name=$(POD_NAME)",
        f"--data-dir={ETCD_DATA_DIR}/data",
        f"--listen-client-urls=http://0.0.0.0:{ETCD_CLIENT_PORT}",
        f"--advertise-client-urls=http://{peer}:{ETCD_CLIENT_PORT}",
        f"--listen-peer-urls=http://0.0.0.0:{ETCD_PEER_PORT}",
        f"--initial-advertise-peer-urls=http://{peer}:{ETCD_PEER_PORT}",
        f"--initial-cluster={members}",
        "--initial-cluster-state=new",
        f"--initial-cluster-token={ha_cluster_id(resource)}",
    ]
    pod_labels = labels(resource, "etcd", COMPONENT_ETCD)
    health = {"httpGet": {"path": "/health", "port": "client"}, "timeoutSeconds": 5}
    container: dict[str, Any] = {
        "name": ETCD_CONTAINER,
        "image": etcd.image,
        "command": command,
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [
            {"name": "client", "containerPort": ETCD_CLIENT_PORT, "protocol": "TCP"},
            {"name": "peer", "containerPort": ETCD_PEER_PORT, "protocol": "TCP"},
        ],
        "readinessProbe": {**health, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**health, "initialDelaySeconds": 15, "periodSeconds": 10, "failureThreshold": 6},
        "volumeMounts": [{"name": "data", "mountPath": ETCD_DATA_DIR}],
    }
    # The user's resources replace the defaults as a whole (a request without our limit is theirs to pick).
    container["resources"] = container_resources(etcd.resources) or {
        key: dict(value) for key, value in DEFAULT_ETCD_RESOURCES.items()
    }
    container["securityContext"] = etcd_container_security_context()
    claim_spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": etcd.storage_size}},
    }
    if etcd.storage_class_name is not None:
        claim_spec["storageClassName"] = etcd.storage_class_name
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": object_meta(resource, ha_names.etcd, pod_labels, owner_uid),
        "spec": {
            "serviceName": ha_names.etcd,
            "replicas": etcd.replicas,
            # Members of a new cluster must start together (each waits for a quorum to form).
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": selector(resource, COMPONENT_ETCD)},
            "template": {
                "metadata": {"labels": dict(pod_labels)},
                "spec": {
                    **pod_hardening(resource.spec),
                    "securityContext": etcd_pod_security_context(),
                    "affinity": with_spread(None, resource, COMPONENT_ETCD),
                    "containers": [container],
                },
            },
            "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": claim_spec}],
        },
    }
