"""Pure builders: a validated MooncakeServing -> the manifests of every child object (no I/O, no client).

Children of a resource named NAME in namespace NS:

  ConfigMap    NAME-store-config   mooncake_store.json, master address = the master Service
  Service      NAME-master         RPC (50051) and metrics (9003) of the Mooncake master
  Deployment   NAME-master         one mooncake_master, Recreate (never two masters)
  Service      NAME-replicas       headless: NAME-replica-<i>.NAME-replicas.NS.svc for the canary
  StatefulSet  NAME-replica        the vLLM replicas, one pod template (so hash seed, block size and
                                   connector settings cannot diverge), stable identities
  Service      NAME                client traffic: only replica pods labelled TRAFFIC_LABEL=on
  PodDisruptionBudget NAME-replica at most one replica voluntarily disrupted (node drains)
  NetworkPolicy NAME-master, NAME-replica  who may reach the master's and the replicas' ports
                                   (and NAME-etcd for a managed etcd)
                                   (unless spec.networkPolicy.enabled is false)

The replica command line, environment and store config come from `engine_args`, the module the sandbox
uses too. Every object carries the app.kubernetes.io labels and a controller owner reference.
"""

from __future__ import annotations

import json
import math
import posixpath
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import yaml

from mooncake_operator import __version__, api
from mooncake_operator.api import (
    MooncakeServing,
    MooncakeServingSpec,
    NetworkPolicyPeer,
    ResourceRequirements,
    Scheduling,
)
from mooncake_operator.digests import json_digest, short_digest
from mooncake_operator.engine_args import (
    DEFAULT_STORE_CONFIG_PATH,
    ETCD_CA_DIR,
    HaTopology,
    master_argv,
    replica_launch,
)
from mooncake_operator.safe_yaml import NoAliasDumper

Manifest = dict[str, Any]

MANAGED_BY = "mooncake-operator"
PART_OF = "mooncake-serving"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
# On the children, not on pod templates: an operator upgrade must not roll the engines.
LABEL_VERSION = "app.kubernetes.io/version"

# The client Service selects only replica pods carrying TRAFFIC_LABEL=TRAFFIC_ON. Pods start with
# TRAFFIC_OFF (an unproven replica must not answer users); the operator sets TRAFFIC_ON on a pod once a
# canary proved it, and back to OFF on a replica a failed canary blames, without touching the pod
# template, so no rollout is triggered.
TRAFFIC_LABEL = f"{api.GROUP}/traffic"
TRAFFIC_ON = "on"
TRAFFIC_OFF = "off"
# Hash of the store config on the pod template: a config change rolls the replicas.
CONFIG_HASH_ANNOTATION = f"{api.GROUP}/config-hash"
# On a replica StatefulSet: the digest of the pod template it was applied with (BlueGreen compares it).
TEMPLATE_ANNOTATION = f"{api.GROUP}/template"
# On a BlueGreen candidate set's pods and selector: which set they belong to (sets share the instance's
# labels, and a StatefulSet selector is immutable, so the first set keeps the plain selector).
REPLICA_SET_LABEL = f"{api.GROUP}/replica-set"

COMPONENT_MASTER = "store-master"
COMPONENT_STORE_CONFIG = "store-config"
COMPONENT_REPLICA = "engine"
COMPONENT_ETCD = "store-etcd"

# The ConfigMap is mounted as the directory of the path engine_args puts into MOONCAKE_CONFIG_PATH.
STORE_CONFIG_DIR, STORE_CONFIG_KEY = posixpath.split(DEFAULT_STORE_CONFIG_PATH)
HF_HOME = api.HF_HOME_PATH
# vLLM 0.32's MooncakeStore worker passes this (else its guess of the host IP) to the store as its address.
LOCAL_HOSTNAME_ENV = "MOONCAKE_REQUESTER_LOCAL_HOSTNAME"
ENGINE_CONTAINER = "vllm"
MASTER_CONTAINER = "mooncake-master"
HTTP_PORT_NAME = "http"
RPC_PORT_NAME = "rpc"
METRICS_PORT_NAME = "metrics"
HEALTH_PATH = "/health"
STARTUP_PROBE_PERIOD_SECONDS = 10
EPHEMERAL_STORAGE = "ephemeral-storage"
HF_CACHE_VOLUME = "hf-cache"


@dataclass(frozen=True)
class ChildNames:
    store_config: str
    master: str  # Deployment and its Service
    replicas: str  # StatefulSet; pods are f"{replicas}-{ordinal}"
    headless_service: str
    client_service: str

    @classmethod
    def of(cls, name: str) -> ChildNames:
        return cls(
            store_config=f"{name}-store-config",
            master=f"{name}-master",
            replicas=f"{name}-replica",
            headless_service=f"{name}-replicas",
            client_service=name,
        )


# --- small helpers ---------------------------------------------------------------------------------------


def labels(resource: MooncakeServing, app_name: str, component: str) -> dict[str, str]:
    return {
        LABEL_NAME: app_name,
        LABEL_INSTANCE: resource.metadata.name,
        LABEL_COMPONENT: component,
        LABEL_PART_OF: PART_OF,
        LABEL_MANAGED_BY: MANAGED_BY,
    }


def selector(resource: MooncakeServing, component: str) -> dict[str, str]:
    """Pod selector: immutable on Deployments and StatefulSets, so only labels that never change."""
    return {LABEL_INSTANCE: resource.metadata.name, LABEL_COMPONENT: component}


def replica_selector_string(resource: MooncakeServing) -> str:
    """Every replica pod of the resource (all its sets), as a serialized label selector (status.selector:
    the scale subresource hands it to autoscalers)."""
    return ",".join(f"{key}={value}" for key, value in sorted(selector(resource, COMPONENT_REPLICA).items()))


def owner_reference(resource: MooncakeServing, owner_uid: str) -> dict[str, Any]:
    """The controller reference that lets the garbage collector remove children with their owner."""
    return {
        "apiVersion": resource.api_version,
        "kind": resource.kind,
        "name": resource.metadata.name,
        "uid": owner_uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_meta(
    resource: MooncakeServing, name: str, object_labels: dict[str, str], owner_uid: str | None
) -> dict[str, Any]:
    """Metadata of a child. Without an owner uid (the resource does not exist yet, e.g. `render` for
    review) there is no owner reference: one with an invented uid would get the child garbage-collected."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": resource.metadata.namespace,
        "labels": {**object_labels, LABEL_VERSION: __version__},
    }
    if owner_uid is not None:
        meta["ownerReferences"] = [owner_reference(resource, owner_uid)]
    return meta


def format_bytes(value: Decimal | int) -> str:
    """A byte count as the largest exact binary quantity ("344Gi", "1536Mi", "100")."""
    whole = math.ceil(value)
    for suffix, size in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if whole and whole % size == 0:
            return f"{whole // size}{suffix}"
    return str(whole)


def store_memory_bytes(spec: MooncakeServingSpec) -> int:
    """Host memory the store takes in one replica: every worker (tensor- times pipeline-parallel) mounts
    its own segment (embedded mode) and allocates its own local transfer buffer."""
    per_worker = spec.store.local_buffer_bytes()
    if spec.store.mode == "embedded":
        per_worker += spec.store.segment_bytes()
    return spec.engine.gpus_per_replica() * per_worker


def _resources(requirements: ResourceRequirements) -> dict[str, dict[str, str | int]]:
    out: dict[str, dict[str, str | int]] = {}
    if requirements.requests:
        out["requests"] = dict(requirements.requests)
    if requirements.limits:
        out["limits"] = dict(requirements.limits)
    return out


def replica_resources(spec: MooncakeServingSpec) -> dict[str, dict[str, str | int]]:
    """engine.resources plus the GPUs (tensor- times pipeline-parallel size) and the store's memory.

    The store's memory is added to the memory request (so the scheduler reserves it) and to a memory
    limit when one is set (so the segment cannot push the engine over it).
    """
    requests: dict[str, str | int] = dict(spec.engine.resources.requests)
    limits: dict[str, str | int] = dict(spec.engine.resources.limits)
    store = store_memory_bytes(spec)
    requests["memory"] = format_bytes(api.parse_quantity(requests.get("memory", 0)) + store)
    if "memory" in limits:
        limits["memory"] = format_bytes(api.parse_quantity(limits["memory"]) + store)
    # An emptyDir cache lives on the node's ephemeral storage: reserve it, or the scheduler places the
    # pod on a node whose disk cannot hold the weights (and the kubelet evicts it mid-download).
    cache_size = spec.model.cache.ephemeral_size
    if cache_size is not None:
        cache = api.parse_quantity(cache_size)
        requests[EPHEMERAL_STORAGE] = format_bytes(
            api.parse_quantity(requests.get(EPHEMERAL_STORAGE, 0)) + cache
        )
        if EPHEMERAL_STORAGE in limits:
            limits[EPHEMERAL_STORAGE] = format_bytes(api.parse_quantity(limits[EPHEMERAL_STORAGE]) + cache)
    rdma = spec.store.rdma
    if rdma is not None and rdma.resource_name is not None:
        count = str(rdma.resource_count)
        requests[rdma.resource_name] = count
        limits[rdma.resource_name] = count
    gpus = str(spec.engine.gpus_per_replica())
    requests[api.GPU_RESOURCE] = gpus
    limits[api.GPU_RESOURCE] = gpus  # extended resources must have limit == request
    return {"requests": requests, "limits": limits}


def store_config_json(resource: MooncakeServing) -> str:
    launch = replica_launch(resource.spec, master_address=master_address(resource), ha=ha_topology(resource))
    return json.dumps(dict(launch.store_config), indent=2) + "\n"


def config_hash(resource: MooncakeServing) -> str:
    return short_digest(store_config_json(resource))


def spec_hash(spec: MooncakeServingSpec) -> str:
    """A short stable digest of a spec (e.g. to record the last good revision)."""
    return json_digest(spec.to_wire())


def master_address(resource: MooncakeServing) -> str:
    """The store config's master address: the master Service, or etcd when the masters elect a leader."""
    ha = ha_topology(resource)
    if ha is not None:
        return ha.master_server_address
    names = ChildNames.of(resource.metadata.name)
    return f"{names.master}.{resource.metadata.namespace}.svc:{resource.spec.store.master.rpc_port}"


def replica_set_name(resource: MooncakeServing, template: str | None = None) -> str:
    """The replica StatefulSet: NAME-replica (the first set, and every InPlace rollout), or, for a
    BlueGreen candidate, NAME-r<7 hex of its pod template digest> (within the pod label limit for
    names of MAX_NAME_LENGTH: "<set>-<10 chars>" controller-revision-hash labels)."""
    name = resource.metadata.name
    return ChildNames.of(name).replicas if template is None else f"{name}-r{template[:7]}"


def replica_pod_names(resource: MooncakeServing, replica_set: str | None = None) -> list[str]:
    set_name = replica_set or ChildNames.of(resource.metadata.name).replicas
    return [f"{set_name}-{ordinal}" for ordinal in range(resource.spec.replicas)]


def replica_urls(resource: MooncakeServing, replica_set: str | None = None) -> list[str]:
    """Per-replica base URLs through the headless Service, in ordinal order (the replicas' stable names;
    the canary dials the IPs of the pods it proved instead, since a foreign pod with the same hostname and
    subdomain shares the name). Every set's pods use the one headless Service."""
    names = ChildNames.of(resource.metadata.name)
    namespace = resource.metadata.namespace
    port = resource.spec.engine.port
    return [
        f"http://{pod}.{names.headless_service}.{namespace}.svc:{port}"
        for pod in replica_pod_names(resource, replica_set)
    ]


def _http_probe(period: int, failures: int, timeout: int = 5) -> dict[str, Any]:
    return {
        "httpGet": {"path": HEALTH_PATH, "port": HTTP_PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


# --- builders ------------------------------------------------------------------------------------------


def store_config_map(resource: MooncakeServing, *, owner_uid: str | None) -> Manifest:
    names = ChildNames.of(resource.metadata.name)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(
            resource,
            names.store_config,
            labels(resource, "mooncake-store", COMPONENT_STORE_CONFIG),
            owner_uid,
        ),
        "data": {STORE_CONFIG_KEY: store_config_json(resource)},
    }


def _master_service_ports(master: api.MasterSpec) -> list[dict[str, Any]]:
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
    resources = _resources(master.resources)
    if resources:
        container["resources"] = resources
    # It needs no GPU; in a CUDA image the NVIDIA runtime would otherwise expose every GPU of the node.
    container["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    container["securityContext"] = master_security_context()
    pod_spec: dict[str, Any] = {**_pod_hardening(spec), **master_placement(spec), "containers": [container]}
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
    template_metadata: dict[str, Any] = {"labels": {**_extra_pod_labels(spec), **pod_labels}}
    annotations = dict(spec.pod_metadata.annotations or {}) if spec.pod_metadata is not None else {}
    if annotations:
        template_metadata["annotations"] = annotations
    return template_metadata


def headless_service(resource: MooncakeServing, *, owner_uid: str | None) -> Manifest:
    names = ChildNames.of(resource.metadata.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(
            resource, names.headless_service, labels(resource, "vllm", COMPONENT_REPLICA), owner_uid
        ),
        "spec": {
            "clusterIP": "None",
            # Every replica stays addressable by name, ready or not, so the canary can reach each one.
            "publishNotReadyAddresses": True,
            "selector": service_selector(resource),
            "ports": [_http_service_port(resource)],
        },
    }


def service_selector(resource: MooncakeServing) -> dict[str, str]:
    """The replica Services' selector: with the managed-by label the operator's watch selects by, so a
    pod it does not see (one with only the instance, component and traffic labels) gets no traffic and
    no per-replica DNS record. Unlike a StatefulSet's, a Service's selector may change."""
    return {**selector(resource, COMPONENT_REPLICA), LABEL_MANAGED_BY: MANAGED_BY}


def client_selector(name: str) -> dict[str, str]:
    """The client Service's selector for resource `name`: its replica pods in user traffic. A pod that
    carries these labels and was not created by the resource's StatefulSet is reported (a foreign pod
    in the Service)."""
    return {
        LABEL_INSTANCE: name,
        LABEL_COMPONENT: COMPONENT_REPLICA,
        LABEL_MANAGED_BY: MANAGED_BY,
        TRAFFIC_LABEL: TRAFFIC_ON,
    }


def client_service(resource: MooncakeServing, *, owner_uid: str | None) -> Manifest:
    names = ChildNames.of(resource.metadata.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(
            resource, names.client_service, labels(resource, "vllm", COMPONENT_REPLICA), owner_uid
        ),
        "spec": {
            "type": "ClusterIP",
            "selector": client_selector(resource.metadata.name),
            "ports": [_http_service_port(resource)],
        },
    }


def _http_service_port(resource: MooncakeServing) -> dict[str, Any]:
    port = resource.spec.engine.port
    return {"name": HTTP_PORT_NAME, "port": port, "targetPort": HTTP_PORT_NAME, "protocol": "TCP"}


def _replica_env(spec: MooncakeServingSpec, launch_env: dict[str, str]) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": key, "value": value} for key, value in launch_env.items()]
    env.append({"name": "HF_HOME", "value": HF_HOME})
    # Caches that default under $HOME go to the writable /tmp volume: the root filesystem may be read-only
    # and the user not root.
    env += [{"name": key, "value": value} for key, value in WRITABLE_CACHE_ENV.items()]
    if spec.model.hf_token_secret_ref is not None:
        # A file, not HF_TOKEN: an environment variable shows in `kubectl describe`, crash dumps and
        # every child process's environment. huggingface_hub (and so vLLM) reads HF_TOKEN_PATH.
        env.append({"name": "HF_TOKEN_PATH", "value": f"{HF_TOKEN_DIR}/{HF_TOKEN_FILE}"})
    # The store client registers this address with the master; the pod IP is what other replicas reach.
    env.append(
        {
            "name": LOCAL_HOSTNAME_ENV,
            "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}},
        }
    )
    # References pass through as references: a Secret's value never enters an object the operator writes.
    env += [item.to_wire() for item in spec.engine.extra_env]
    return env


def _replica_volumes(resource: MooncakeServing) -> list[dict[str, Any]]:
    spec = resource.spec
    names = ChildNames.of(resource.metadata.name)
    shm: dict[str, Any] = {"medium": "Memory"}
    if spec.engine.shared_memory_size is not None:
        shm["sizeLimit"] = spec.engine.shared_memory_size
    cache = spec.model.cache
    volumes: list[dict[str, Any]] = [
        {"name": "store-config", "configMap": {"name": names.store_config}},
        {"name": "dshm", "emptyDir": shm},
        {"name": TMP_VOLUME, "emptyDir": {}},
    ]
    if cache.existing_claim is not None:
        volumes.append(
            {"name": HF_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": cache.existing_claim}}
        )
    elif cache.volume_claim_template is None:  # a claim template provides the volume itself
        empty_dir: dict[str, Any] = {}
        if cache.ephemeral_size is not None:
            empty_dir["sizeLimit"] = cache.ephemeral_size
        volumes.append({"name": HF_CACHE_VOLUME, "emptyDir": empty_dir})
    rdma = spec.store.rdma
    if rdma is not None and rdma.host_devices:
        volumes.append({"name": RDMA_DEVICES_VOLUME, "hostPath": {"path": RDMA_DEVICES_PATH}})
    volumes += etcd_ca_volumes(resource)
    secret = spec.model.hf_token_secret_ref
    if secret is not None:
        items = [{"key": secret.key, "path": HF_TOKEN_FILE}]
        volumes.append({"name": HF_TOKEN_VOLUME, "secret": {"secretName": secret.name, "items": items}})
    volumes += spec.pod.volumes
    return volumes


@dataclass(frozen=True)
class ReplicaTemplate:
    """The replica pod template the spec renders (without a BlueGreen set's own label), rendered once
    per reconcile: its digest `id` names a BlueGreen candidate and annotates the StatefulSet."""

    body: dict[str, Any]
    id: str

    @classmethod
    def of(cls, resource: MooncakeServing) -> ReplicaTemplate:
        body = _replica_pod_template(resource, selector(resource, COMPONENT_REPLICA))
        return cls(body, json_digest(body))

    def for_set(self, set_selector: dict[str, str]) -> dict[str, Any]:
        """The template whose pods carry `set_selector` (the set's label included), in render order."""
        metadata = self.body["metadata"]
        labels = {key: value for key, value in metadata["labels"].items() if key != TRAFFIC_LABEL}
        labels = {**labels, **set_selector, TRAFFIC_LABEL: metadata["labels"][TRAFFIC_LABEL]}
        return {**self.body, "metadata": {**metadata, "labels": labels}}


def replica_template_id(resource: MooncakeServing) -> str:
    """Digest of the replica pod template the spec renders (the set's own label aside): a change starts
    a BlueGreen candidate."""
    return ReplicaTemplate.of(resource).id


def replica_stateful_set(
    resource: MooncakeServing,
    *,
    owner_uid: str | None,
    replica_set: str | None = None,
    template: ReplicaTemplate | None = None,
) -> Manifest:
    """The replica StatefulSet, NAME-replica or (`replica_set`) a BlueGreen set of another name, whose
    selector and pods also carry the set's label. `template`: the spec's, when already rendered."""
    names = ChildNames.of(resource.metadata.name)
    spec = resource.spec
    set_name = replica_set or names.replicas
    set_selector = selector(resource, COMPONENT_REPLICA)
    if set_name != names.replicas:
        set_selector[REPLICA_SET_LABEL] = set_name
    template = template or ReplicaTemplate.of(resource)
    stateful_set_spec: dict[str, Any] = {
        "serviceName": names.headless_service,
        "replicas": spec.replicas,
        # Replicas do not depend on each other; start and replace them in parallel (loading is slow).
        "podManagementPolicy": "Parallel",
        "updateStrategy": {"type": "RollingUpdate"},
        "selector": {"matchLabels": set_selector},
        "template": template.for_set(set_selector),
    }
    claim = cache_claim_template(resource)
    if claim is not None:
        stateful_set_spec["volumeClaimTemplates"] = [claim]
    metadata = object_meta(resource, set_name, labels(resource, "vllm", COMPONENT_REPLICA), owner_uid)
    metadata["annotations"] = {TEMPLATE_ANNOTATION: template.id}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": metadata, "spec": stateful_set_spec}


def _replica_pod_template(resource: MooncakeServing, set_selector: dict[str, str]) -> dict[str, Any]:
    spec = resource.spec
    launch = replica_launch(
        spec,
        master_address=master_address(resource),
        port=spec.engine.port,
        store_config_path=DEFAULT_STORE_CONFIG_PATH,
        ha=ha_topology(resource),
    )
    pod_labels = {**labels(resource, "vllm", COMPONENT_REPLICA), **set_selector, TRAFFIC_LABEL: TRAFFIC_OFF}
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": spec.engine.image,
        "command": replica_command(spec, launch.argv),
        "env": _replica_env(spec, dict(launch.env)),
        "ports": [{"name": HTTP_PORT_NAME, "containerPort": spec.engine.port, "protocol": "TCP"}],
        # Weights download and load can take long; the startup probe bounds it, then /health is watched.
        "startupProbe": _http_probe(
            STARTUP_PROBE_PERIOD_SECONDS,
            math.ceil(spec.engine.startup_timeout_seconds / STARTUP_PROBE_PERIOD_SECONDS),
        ),
        "readinessProbe": _http_probe(period=5, failures=3),
        "livenessProbe": _http_probe(period=10, failures=6),
        "resources": replica_resources(spec),
        "volumeMounts": [
            {"name": "store-config", "mountPath": STORE_CONFIG_DIR, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": HF_CACHE_VOLUME, "mountPath": HF_HOME},
            {"name": TMP_VOLUME, "mountPath": api.TMP_PATH},
            *etcd_ca_mounts(resource),
            *(
                [{"name": HF_TOKEN_VOLUME, "mountPath": HF_TOKEN_DIR, "readOnly": True}]
                if spec.model.hf_token_secret_ref is not None
                else []
            ),
        ],
        "lifecycle": {"preStop": {"exec": {"command": drain_command(spec)}}},
        "securityContext": replica_security_context(spec),
    }
    if spec.store.rdma is not None and spec.store.rdma.host_devices:
        container["volumeMounts"].append({"name": RDMA_DEVICES_VOLUME, "mountPath": RDMA_DEVICES_PATH})
    container["volumeMounts"] += [mount.to_wire() for mount in spec.pod.volume_mounts]
    pod_spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": spec.pod.drain_seconds + ENGINE_SHUTDOWN_SECONDS,
        **_pod_hardening(spec),
        **replica_identity(spec),
        **replica_placement(resource),
        "containers": [container, *spec.pod.sidecars],
        "volumes": _replica_volumes(resource),
    }
    if spec.pod.init_containers:
        pod_spec["initContainers"] = list(spec.pod.init_containers)
    return {
        "metadata": {
            "labels": {**_extra_pod_labels(spec), **pod_labels},
            "annotations": {**_extra_pod_annotations(spec), CONFIG_HASH_ANNOTATION: config_hash(resource)},
        },
        "spec": pod_spec,
    }


# --- pods on a real cluster: placement, storage, RDMA, hardening, disruption budget, network policy ------

POLICY_V1 = "policy/v1"
# Kubernetes before 1.21 (such as the 1.20 API server of the cluster tests) serves PodDisruptionBudget
# only as policy/v1beta1, with the same fields; 1.25 and later serve only policy/v1.
POLICY_V1BETA1 = "policy/v1beta1"
POLICY_API_VERSIONS = (POLICY_V1, POLICY_V1BETA1)
RDMA_DEVICES_VOLUME = "rdma-devices"
HF_TOKEN_VOLUME = "hf-token"
HF_TOKEN_DIR = "/etc/mooncake/hf-token"
HF_TOKEN_FILE = "token"
RDMA_DEVICES_PATH = "/dev/infiniband"
# `ulimit -l unlimited` raises the memlock hard limit (needs CAP_SYS_RESOURCE), then the engine replaces
# the shell; the engine's argv follows as "$0" "$@", unchanged and unquoted by any shell.
MEMLOCK_WRAPPER = ("/bin/sh", "-c", 'ulimit -l unlimited && exec "$0" "$@"')
# The master needs no privileges: measured with the real mooncake_master (bench/RESULTS.md).
MASTER_USER_ID = 65532
# Where the operator runs when nobody says (the namespace docs/install.md installs the chart into); the
# operator itself passes its own (`run --operator-namespace`, the chart's release namespace).
DEFAULT_OPERATOR_NAMESPACE = "mooncake-system"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace (1.21+)


def operator_peer(operator_namespace: str) -> dict[str, Any]:
    """The operator's pods in the operator's own namespace only: the label alone would admit any pod of any
    namespace that carries it (every tenant can label its own pods)."""
    return {
        "podSelector": {"matchLabels": {LABEL_NAME: "mooncake-operator"}},
        "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: operator_namespace}},
    }


TMP_VOLUME = "tmp"
WRITABLE_CACHE_ENV = {"XDG_CACHE_HOME": "/tmp/cache", "TRITON_CACHE_DIR": "/tmp/triton"}
ENGINE_SHUTDOWN_SECONDS = 30
DRAIN_SETTLE_SECONDS = 5
# Run by the engine image's python3 (stdlib only). argv: port, budget, settle seconds. Any failure to read
# the metrics ends the wait: the server is gone, or the hook cannot tell, and SIGTERM follows either way.
DRAIN_SCRIPT = """\
import sys, time, urllib.request
port, budget, settle = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + budget
time.sleep(settle)
gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting")
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        busy = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(gauges))
    except Exception:
        break
    if busy == 0:
        break
    time.sleep(1)
"""


def replica_command(spec: MooncakeServingSpec, argv: tuple[str, ...]) -> list[str]:
    rdma = spec.store.rdma
    if rdma is not None and rdma.memlock == "Wrapper":
        return [*MEMLOCK_WRAPPER, *argv]
    return list(argv)


def rdma_capabilities(spec: MooncakeServingSpec) -> list[str]:
    """RDMA registers (pins) memory: IPC_LOCK lifts the kernel's memlock check for that; SYS_RESOURCE
    lets the memlock wrapper raise the limit user-space libraries read. Neither is in Pod Security
    "baseline": a namespace running RDMA replicas needs "privileged"."""
    rdma = spec.store.rdma
    if rdma is None or rdma.host_devices:
        return []
    return ["IPC_LOCK"] + (["SYS_RESOURCE"] if rdma.memlock == "Wrapper" else [])


def replica_security_context(spec: MooncakeServingSpec) -> dict[str, Any]:
    """The engine container's securityContext: the defaults, each field the user sets replacing its
    default, then what RDMA needs added (capabilities; /dev/infiniband from the node can only be opened by
    a privileged container, the device cgroup denies it otherwise)."""
    rdma = spec.store.rdma
    host_devices = rdma is not None and rdma.host_devices
    # Privileged gets every capability whatever is dropped, and the API server refuses it next to
    # allowPrivilegeEscalation: false: no defaults then.
    context: dict[str, Any] = (
        {} if host_devices else {"capabilities": {"drop": ["ALL"]}, "allowPrivilegeEscalation": False}
    )
    if spec.engine.security_context is not None:
        context.update(spec.engine.security_context.to_wire())
    needed = rdma_capabilities(spec)
    if needed:
        capabilities = dict(context.get("capabilities", {}))
        capabilities["add"] = [
            *capabilities.get("add", []),
            *(c for c in needed if c not in capabilities.get("add", [])),
        ]
        context["capabilities"] = capabilities
    if host_devices:
        context["privileged"] = True
    return context


def replica_identity(spec: MooncakeServingSpec) -> dict[str, Any]:
    """Pod securityContext, ServiceAccount, API token and RuntimeClass of the replica pods."""
    pod = spec.pod
    context: dict[str, Any] = {"seccompProfile": {"type": "RuntimeDefault"}}
    if pod.security_context is not None:
        context.update(pod.security_context.to_wire())
    out: dict[str, Any] = {"securityContext": context}
    if pod.service_account_name is not None:
        out["serviceAccountName"] = pod.service_account_name
        out["automountServiceAccountToken"] = pod.automount_service_account_token
    if pod.runtime_class_name is not None:
        out["runtimeClassName"] = pod.runtime_class_name
    return out


def drain_command(spec: MooncakeServingSpec) -> list[str]:
    """The engine's preStop: a terminating pod leaves the Services' endpoints (no new requests once
    kube-proxy and the clients' load balancers notice, DRAIN_SETTLE_SECONDS), then the hook waits until
    vLLM runs and queues no request, at most pod.drainSeconds; the kubelet sends SIGTERM after it."""
    budget = spec.pod.drain_seconds
    return [
        "python3",
        "-c",
        DRAIN_SCRIPT,
        str(spec.engine.port),
        str(budget),
        str(min(DRAIN_SETTLE_SECONDS, budget)),
    ]


def _pod_hardening(spec: MooncakeServingSpec) -> dict[str, Any]:
    """Pod-level settings every pod of the resource shares: no API token (they never call the API, and
    trustRemoteCode runs model code; replicas with pod.serviceAccountName say so themselves), the image
    pull secrets."""
    out: dict[str, Any] = {"automountServiceAccountToken": False}
    if spec.image_pull_secrets:
        out["imagePullSecrets"] = [secret.to_wire() for secret in spec.image_pull_secrets]
    return out


def _scheduling_fields(scheduling: Scheduling | None) -> dict[str, Any]:
    """The Kubernetes scheduling fields of `scheduling`, unchanged (affinity handled by the caller)."""
    if scheduling is None:
        return {}
    wire = scheduling.to_wire()
    return {
        key: wire[key]
        for key in ("nodeSelector", "tolerations", "topologySpreadConstraints", "priorityClassName")
        if key in wire
    }


def replica_anti_affinity_mode(spec: MooncakeServingSpec) -> str:
    host_network = spec.store.rdma is not None and spec.store.rdma.host_network
    chosen = spec.scheduling.replica_anti_affinity if spec.scheduling is not None else None
    if chosen is None:
        return "Required" if host_network else "Preferred"
    return chosen


def replica_affinity(resource: MooncakeServing) -> dict[str, Any] | None:
    """The user's affinity with the replicas' own anti-affinity term added to podAntiAffinity.

    The user's terms all stay (node and pod affinity untouched; their anti-affinity terms kept, ours
    appended), so a user's rule always applies and ours only adds a spread; replicaAntiAffinity: None
    leaves the user's affinity exactly as written.
    """
    spec = resource.spec
    user = spec.scheduling.affinity if spec.scheduling is not None else None
    affinity: dict[str, Any] = user.to_wire() if user is not None else {}
    mode = replica_anti_affinity_mode(spec)
    if mode != "None":
        term = {
            "labelSelector": {"matchLabels": selector(resource, COMPONENT_REPLICA)},
            "topologyKey": api.HOSTNAME_TOPOLOGY_KEY,
        }
        anti = dict(affinity.get("podAntiAffinity", {}))
        if mode == "Required":
            key = "requiredDuringSchedulingIgnoredDuringExecution"
            anti[key] = [*anti.get(key, []), term]
        else:
            key = "preferredDuringSchedulingIgnoredDuringExecution"
            anti[key] = [*anti.get(key, []), {"weight": 100, "podAffinityTerm": term}]
        affinity["podAntiAffinity"] = anti
    return affinity or None


def replica_placement(resource: MooncakeServing) -> dict[str, Any]:
    spec = resource.spec
    out = _scheduling_fields(spec.scheduling)
    affinity = replica_affinity(resource)
    if affinity is not None:
        out["affinity"] = affinity
    rdma = spec.store.rdma
    if rdma is not None and rdma.host_network:
        out["hostNetwork"] = True
        # On the host network the pod still needs cluster DNS to find the master Service.
        out["dnsPolicy"] = "ClusterFirstWithHostNet"
    return out


def master_placement(spec: MooncakeServingSpec) -> dict[str, Any]:
    scheduling = spec.store.master.scheduling
    out = _scheduling_fields(scheduling)
    if scheduling is not None and scheduling.affinity is not None:
        out["affinity"] = scheduling.affinity.to_wire()
    return out


def _extra_pod_labels(spec: MooncakeServingSpec) -> dict[str, str]:
    return dict(spec.pod_metadata.labels or {}) if spec.pod_metadata is not None else {}


def _extra_pod_annotations(spec: MooncakeServingSpec) -> dict[str, str]:
    annotations = dict(spec.pod_metadata.annotations or {}) if spec.pod_metadata is not None else {}
    rdma = spec.store.rdma
    if rdma is not None and rdma.networks is not None:
        annotations[api.MULTUS_NETWORKS_ANNOTATION] = rdma.networks
    return annotations


def cache_claim_template(resource: MooncakeServing) -> dict[str, Any] | None:
    """The per-replica cache claim (hf-cache-NAME-replica-<i>), or None for the other cache kinds."""
    template = resource.spec.model.cache.volume_claim_template
    if template is None:
        return None
    claim_spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": template.size}},
    }
    if template.storage_class_name is not None:
        claim_spec["storageClassName"] = template.storage_class_name
    return {
        "metadata": {"name": HF_CACHE_VOLUME, "labels": selector(resource, COMPONENT_REPLICA)},
        "spec": claim_spec,
    }


def pod_disruption_budget(
    resource: MooncakeServing, *, owner_uid: str | None, api_version: str = POLICY_V1
) -> Manifest:
    """At most one replica down through voluntary disruptions (drains); StatefulSet rollouts do not go
    through evictions, so this does not slow them."""
    if api_version not in POLICY_API_VERSIONS:
        raise ValueError(f"PodDisruptionBudget apiVersion must be one of {POLICY_API_VERSIONS}")
    names = ChildNames.of(resource.metadata.name)
    return {
        "apiVersion": api_version,
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(
            resource, names.replicas, labels(resource, "vllm", COMPONENT_REPLICA), owner_uid
        ),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector(resource, COMPONENT_REPLICA)},
        },
    }


# --- highly available masters ------------------------------------------------------------------------
#
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


@dataclass(frozen=True)
class HaNames:
    masters_headless: str  # headless Service of the master StatefulSet
    etcd: str  # StatefulSet and its headless Service

    @classmethod
    def of(cls, name: str) -> HaNames:
        return cls(masters_headless=f"{name}-masters", etcd=f"{name}-etcd")


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


def master_pod_urls(resource: MooncakeServing) -> list[str]:
    """Each HA master's admin endpoint (/health says role and leader), in ordinal order."""
    names, ha_names = ChildNames.of(resource.metadata.name), HaNames.of(resource.metadata.name)
    namespace = resource.metadata.namespace
    port = resource.spec.store.master.metrics_port
    replicas = resource.spec.store.master.high_availability.replicas
    return [
        f"http://{names.master}-{i}.{ha_names.masters_headless}.{namespace}.svc:{port}"
        for i in range(replicas)
    ]


def _with_spread(user: dict[str, Any] | None, resource: MooncakeServing, component: str) -> dict[str, Any]:
    """The user's affinity plus a preference for one pod per node: a node failure then takes at most one
    master (or etcd member). The user's terms all stay; ours is appended."""
    affinity = dict(user or {})
    anti = dict(affinity.get("podAntiAffinity", {}))
    key = "preferredDuringSchedulingIgnoredDuringExecution"
    term = {
        "topologyKey": api.HOSTNAME_TOPOLOGY_KEY,
        "labelSelector": {"matchLabels": selector(resource, component)},
    }
    anti[key] = [*anti.get(key, []), {"weight": 100, "podAffinityTerm": term}]
    affinity["podAntiAffinity"] = anti
    return affinity


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
    resources = _resources(master.resources)
    if resources:
        container["resources"] = resources
    container["securityContext"] = master_security_context()
    placement = master_placement(spec)
    pod_spec: dict[str, Any] = {
        **_pod_hardening(spec),
        **placement,
        "affinity": _with_spread(placement.get("affinity"), resource, COMPONENT_MASTER),
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
    resources = _resources(etcd.resources)
    if resources:
        container["resources"] = resources
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
                    **_pod_hardening(resource.spec),
                    "affinity": _with_spread(None, resource, COMPONENT_ETCD),
                    "containers": [container],
                },
            },
            "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": claim_spec}],
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


def _master_children(resource: MooncakeServing, *, owner_uid: str | None) -> list[Manifest]:
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


def _peers(peers: list[NetworkPolicyPeer]) -> list[dict[str, Any]]:
    return [peer.to_wire() for peer in peers]


# Who may call the replicas' HTTP port when a resource lists no clients (the operator's setting).
REPLICA_INGRESS_DEFAULTS = ("anyone", "listed-clients")
# Where the replicas resolve names when spec.networkPolicy.egress.dns is unset (kubeadm, most distributions).
DEFAULT_DNS_PEER: dict[str, Any] = {
    "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: "kube-system"}},
    "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
}


def network_policies(
    resource: MooncakeServing,
    *,
    owner_uid: str | None,
    operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE,
    open_http_by_default: bool = True,
    template: ReplicaTemplate | None = None,
) -> list[Manifest]:
    """Ingress of the master (RPC from this resource's replicas; with highly available masters, the
    operator on the metrics port for /health) and of the replicas (any port from each other: the store
    client's transfer port is picked at start-up; the HTTP port from the operator and the declared
    clients; when clients is unset, from anyone if `open_http_by_default`, else from the operator only).
    Pure: the operator's namespace and its ingress default are arguments.

    The master's metrics port also serves the pinned mooncake_master's admin API (`/api/v1/remove_all`,
    quotas, drains), so nobody but the operator is admitted to it: `metricsScrapers` are not (see
    docs/api.md). A managed etcd gets a third: its client port from this resource's masters and
    replicas, its peer port from its own members. The replicas' egress is restricted when
    spec.networkPolicy.egress is set: DNS, the store's peers, masters and managed etcd, and egress.to.
    """
    spec = resource.spec
    policy = spec.network_policy
    if not policy.enabled:
        return []
    names = ChildNames.of(resource.metadata.name)
    replicas_peer = {"podSelector": {"matchLabels": selector(resource, COMPONENT_REPLICA)}}
    operator = policy.operator.to_wire() if policy.operator is not None else operator_peer(operator_namespace)
    master = spec.store.master
    master_rules = [{"from": [replicas_peer], "ports": [{"protocol": "TCP", "port": master.rpc_port}]}]
    if ha_enabled(resource):  # the operator asks every highly available master who leads (/health)
        master_rules.append({"from": [operator], "ports": [{"protocol": "TCP", "port": master.metrics_port}]})
    http_rule: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": spec.engine.port}]}
    if policy.clients is not None:
        http_rule["from"] = [operator, *_peers(policy.clients)]
    elif not open_http_by_default:
        http_rule["from"] = [operator]
    replica_rules = [{"from": [replicas_peer]}, http_rule]
    managed_etcd = ha_enabled(resource) and master.high_availability.etcd.managed_or_default() is not None

    def build(
        name: str,
        app: str,
        component: str,
        rules: list[dict[str, Any]],
        egress: list[dict[str, Any]] | None = None,
    ) -> Manifest:
        policy_spec: dict[str, Any] = {
            "podSelector": {"matchLabels": selector(resource, component)},
            "policyTypes": ["Ingress"] if egress is None else ["Ingress", "Egress"],
            "ingress": rules,
        }
        if egress is not None:
            policy_spec["egress"] = egress
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": object_meta(resource, name, labels(resource, app, component), owner_uid),
            "spec": policy_spec,
        }

    replica_egress: list[dict[str, Any]] | None = None
    if policy.egress is not None:
        dns = _peers(policy.egress.dns) if policy.egress.dns is not None else [DEFAULT_DNS_PEER]
        masters_peer = {"podSelector": {"matchLabels": selector(resource, COMPONENT_MASTER)}}
        replica_egress = [
            {"to": dns, "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
            {"to": [replicas_peer]},  # the store's transfers: a port each picks at start-up
            {"to": [masters_peer], "ports": [{"protocol": "TCP", "port": master.rpc_port}]},
        ]
        if managed_etcd:  # the store clients follow the leader through etcd
            etcd_peer = {"podSelector": {"matchLabels": selector(resource, COMPONENT_ETCD)}}
            replica_egress.append(
                {"to": [etcd_peer], "ports": [{"protocol": "TCP", "port": ETCD_CLIENT_PORT}]}
            )
        replica_egress += [rule.to_wire() for rule in policy.egress.to]

    policies = [
        build(names.master, "mooncake-master", COMPONENT_MASTER, master_rules),
        build(names.replicas, "vllm", COMPONENT_REPLICA, replica_rules, replica_egress),
    ]
    if managed_etcd:
        # The managed etcd has no authentication: whoever reaches its client port can rewrite
        # master_view and send the store clients to a master of their choosing.
        masters_peer = {"podSelector": {"matchLabels": selector(resource, COMPONENT_MASTER)}}
        members_peer = {"podSelector": {"matchLabels": selector(resource, COMPONENT_ETCD)}}
        etcd_rules = [
            {"from": [masters_peer, replicas_peer], "ports": [{"protocol": "TCP", "port": ETCD_CLIENT_PORT}]},
            {"from": [members_peer], "ports": [{"protocol": "TCP", "port": ETCD_PEER_PORT}]},
        ]
        policies.append(build(HaNames.of(resource.metadata.name).etcd, "etcd", COMPONENT_ETCD, etcd_rules))
    return policies


def render_all(
    resource: MooncakeServing,
    *,
    owner_uid: str | None,
    policy_api_version: str = POLICY_V1,
    replica_set: str | None = None,
    operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE,
    open_http_by_default: bool = True,
    template: ReplicaTemplate | None = None,
) -> list[Manifest]:
    """Every child object, in apply order: network policies first (so no pod starts unprotected),
    config and master, replicas next, services and the disruption budget for them.

    `policy_api_version`: the PodDisruptionBudget's apiVersion the cluster serves (`policy/v1` from
    Kubernetes 1.21 on; the operator asks the API server which one it serves). `replica_set`: the
    replica StatefulSet rendered from this spec (a BlueGreen candidate's name); another set (the one
    serving during a BlueGreen rollout) is not rendered, so it is left as it runs. `operator_namespace`:
    where the operator's pods run, the only namespace its NetworkPolicy peer admits.
    `open_http_by_default`: whether the replicas' HTTP port admits anyone when no clients are listed.
    `template`: the replica pod template, when the caller already rendered it (`ReplicaTemplate.of`)."""
    return [
        *network_policies(
            resource,
            owner_uid=owner_uid,
            operator_namespace=operator_namespace,
            open_http_by_default=open_http_by_default,
        ),
        store_config_map(resource, owner_uid=owner_uid),
        *_master_children(resource, owner_uid=owner_uid),
        headless_service(resource, owner_uid=owner_uid),
        replica_stateful_set(resource, owner_uid=owner_uid, replica_set=replica_set, template=template),
        client_service(resource, owner_uid=owner_uid),
        pod_disruption_budget(resource, owner_uid=owner_uid, api_version=policy_api_version),
    ]


class _ManifestDumper(NoAliasDumper):
    """Readable manifests: multi-line strings (the store config) as literal blocks."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_ManifestDumper.add_representer(str, _represent_str)


def to_yaml_stream(manifests: list[Manifest]) -> str:
    """Manifests as one YAML stream ("---"-separated documents), keys in builder order."""
    return yaml.dump_all(manifests, Dumper=_ManifestDumper, sort_keys=False, explicit_start=True, width=120)
