"""The vLLM replicas: their StatefulSet and pod template (command line and environment from
`engine_args`, volumes, probes, resources with the store's memory and the GPUs), the engine
container's security, the graceful drain, and placement (anti-affinity, RDMA's host network).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mooncake_operator.api.kube_types import GPU_RESOURCE, HOSTNAME_TOPOLOGY_KEY, MULTUS_NETWORKS_ANNOTATION
from mooncake_operator.api.quantities import format_bytes, parse_quantity
from mooncake_operator.api.replica_pod import HF_HOME_PATH, TMP_PATH
from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.api.spec import MooncakeServingSpec
from mooncake_operator.build.digests import json_digest
from mooncake_operator.build.engine_args import (
    DEFAULT_STORE_CONFIG_PATH,
    SHUTDOWN_TIMEOUT_SECONDS,
    replica_launch,
)
from mooncake_operator.build.etcd import etcd_ca_mounts, etcd_ca_volumes, ha_topology
from mooncake_operator.build.names import (
    COMPONENT_REPLICA,
    CONFIG_HASH_ANNOTATION,
    ENGINE_CONTAINER,
    HEALTH_PATH,
    HTTP_PORT_NAME,
    REPLICA_SET_LABEL,
    TEMPLATE_ANNOTATION,
    TRAFFIC_LABEL,
    TRAFFIC_OFF,
    ChildNames,
    Manifest,
    labels,
    object_meta,
    selector,
)
from mooncake_operator.build.pods import extra_pod_labels, pod_hardening, scheduling_fields
from mooncake_operator.build.store_config import STORE_CONFIG_DIR, config_hash, master_address

HF_HOME = HF_HOME_PATH
# vLLM 0.32's MooncakeStore worker passes this (else its guess of the host IP) to the store as its address.
LOCAL_HOSTNAME_ENV = "MOONCAKE_REQUESTER_LOCAL_HOSTNAME"
STARTUP_PROBE_PERIOD_SECONDS = 10
EPHEMERAL_STORAGE = "ephemeral-storage"
HF_CACHE_VOLUME = "hf-cache"


def store_memory_bytes(spec: MooncakeServingSpec) -> int:
    """Host memory the store takes in one replica: every worker (tensor- times pipeline-parallel) mounts
    its own segment (embedded mode) and allocates its own local transfer buffer."""
    per_worker = spec.store.local_buffer_bytes()
    if spec.store.mode == "embedded":
        per_worker += spec.store.segment_bytes()
    return spec.engine.gpus_per_replica() * per_worker


def replica_resources(spec: MooncakeServingSpec) -> dict[str, dict[str, str | int]]:
    """engine.resources plus the GPUs (tensor- times pipeline-parallel size) and the store's memory.

    The store's memory is added to the memory request (so the scheduler reserves it) and to a memory
    limit when one is set (so the segment cannot push the engine over it).
    """
    requests: dict[str, str | int] = dict(spec.engine.resources.requests)
    limits: dict[str, str | int] = dict(spec.engine.resources.limits)
    store = store_memory_bytes(spec)
    requests["memory"] = format_bytes(parse_quantity(requests.get("memory", 0)) + store)
    if "memory" in limits:
        limits["memory"] = format_bytes(parse_quantity(limits["memory"]) + store)
    # emptyDirs live on the node's ephemeral storage: reserve them, or the scheduler places the pod on a
    # node whose disk cannot hold them (and the kubelet evicts it mid-download or mid-compile). The /tmp
    # scratch always; the weights cache when it is an emptyDir.
    on_node = parse_quantity(spec.pod.scratch_size)
    if spec.model.cache.ephemeral_size is not None:
        on_node += parse_quantity(spec.model.cache.ephemeral_size)
    requests[EPHEMERAL_STORAGE] = format_bytes(parse_quantity(requests.get(EPHEMERAL_STORAGE, 0)) + on_node)
    if EPHEMERAL_STORAGE in limits:
        limits[EPHEMERAL_STORAGE] = format_bytes(parse_quantity(limits[EPHEMERAL_STORAGE]) + on_node)
    rdma = spec.store.rdma
    if rdma is not None and rdma.resource_name is not None:
        count = str(rdma.resource_count)
        requests[rdma.resource_name] = count
        limits[rdma.resource_name] = count
    gpus = str(spec.engine.gpus_per_replica())
    requests[GPU_RESOURCE] = gpus
    limits[GPU_RESOURCE] = gpus  # extended resources must have limit == request
    return {"requests": requests, "limits": limits}


def _http_probe(period: int, failures: int, timeout: int = 5) -> dict[str, Any]:
    return {
        "httpGet": {"path": HEALTH_PATH, "port": HTTP_PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


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
        {"name": TMP_VOLUME, "emptyDir": {"sizeLimit": spec.pod.scratch_size}},
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
        body = replica_pod_template(resource, selector(resource, COMPONENT_REPLICA))
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
    replicas: int | None = None,
    partition: int | None = None,
) -> Manifest:
    """The replica StatefulSet, NAME-replica or (`replica_set`) a BlueGreen set of another name, whose
    selector and pods also carry the set's label. `template`: the spec's, when already rendered.
    `replicas`, `partition`: what the operator's rollout step asks (default spec.replicas, and no
    partition: every pod at the template); the pods below the partition keep their template."""
    names = ChildNames.of(resource.metadata.name)
    spec = resource.spec
    set_name = replica_set or names.replicas
    set_selector = selector(resource, COMPONENT_REPLICA)
    if set_name != names.replicas:
        set_selector[REPLICA_SET_LABEL] = set_name
    template = template or ReplicaTemplate.of(resource)
    stateful_set_spec: dict[str, Any] = {
        "serviceName": names.headless_service,
        "replicas": spec.replicas if replicas is None else replicas,
        # Replicas do not depend on each other; start and replace them in parallel (loading is slow).
        "podManagementPolicy": "Parallel",
        "updateStrategy": (
            {"type": "RollingUpdate"}
            if partition is None
            else {"type": "RollingUpdate", "rollingUpdate": {"partition": partition}}
        ),
        "selector": {"matchLabels": set_selector},
        "template": template.for_set(set_selector),
    }
    claim = cache_claim_template(resource)
    if claim is not None:
        stateful_set_spec["volumeClaimTemplates"] = [claim]
    metadata = object_meta(resource, set_name, labels(resource, "vllm", COMPONENT_REPLICA), owner_uid)
    metadata["annotations"] = {TEMPLATE_ANNOTATION: template.id}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": metadata, "spec": stateful_set_spec}


def replica_pod_template(resource: MooncakeServing, set_selector: dict[str, str]) -> dict[str, Any]:
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
            {"name": TMP_VOLUME, "mountPath": TMP_PATH},
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
        **pod_hardening(spec),
        **replica_identity(spec),
        **replica_placement(resource),
        "containers": [container, *spec.pod.sidecars],
        "volumes": _replica_volumes(resource),
    }
    if spec.pod.init_containers:
        pod_spec["initContainers"] = list(spec.pod.init_containers)
    return {
        "metadata": {
            "labels": {**extra_pod_labels(spec), **pod_labels},
            "annotations": {**_extra_pod_annotations(spec), CONFIG_HASH_ANNOTATION: config_hash(resource)},
        },
        "spec": pod_spec,
    }


RDMA_DEVICES_VOLUME = "rdma-devices"
HF_TOKEN_VOLUME = "hf-token"
HF_TOKEN_DIR = "/etc/mooncake/hf-token"
HF_TOKEN_FILE = "token"
RDMA_DEVICES_PATH = "/dev/infiniband"
# `ulimit -l unlimited` raises the memlock hard limit (needs CAP_SYS_RESOURCE), then the engine replaces
# the shell; the engine's argv follows as "$0" "$@", unchanged and unquoted by any shell.
MEMLOCK_WRAPPER = ("/bin/sh", "-c", 'ulimit -l unlimited && exec "$0" "$@"')


TMP_VOLUME = "tmp"
WRITABLE_CACHE_ENV = {"XDG_CACHE_HOME": "/tmp/cache", "TRITON_CACHE_DIR": "/tmp/triton"}
# After the preStop drain: the engine's own drain on SIGTERM (--shutdown-timeout), then its teardown
# (the store client waits up to 5 s for queued puts, then closes and unmounts its segment).
ENGINE_SHUTDOWN_SECONDS = SHUTDOWN_TIMEOUT_SECONDS + 10
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
            "topologyKey": HOSTNAME_TOPOLOGY_KEY,
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
    out = scheduling_fields(spec.scheduling)
    affinity = replica_affinity(resource)
    if affinity is not None:
        out["affinity"] = affinity
    rdma = spec.store.rdma
    if rdma is not None and rdma.host_network:
        out["hostNetwork"] = True
        # On the host network the pod still needs cluster DNS to find the master Service.
        out["dnsPolicy"] = "ClusterFirstWithHostNet"
    return out


def _extra_pod_annotations(spec: MooncakeServingSpec) -> dict[str, str]:
    annotations = dict(spec.pod_metadata.annotations or {}) if spec.pod_metadata is not None else {}
    rdma = spec.store.rdma
    if rdma is not None and rdma.networks is not None:
        annotations[MULTUS_NETWORKS_ANNOTATION] = rdma.networks
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
