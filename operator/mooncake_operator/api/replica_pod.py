"""Where and how the pods run beyond the engine: scheduling, extra pod metadata, and the replica
pods' security, identity, graceful drain and escape hatches (extra volumes, sidecars, init
containers). The operator sets hardened defaults (Pod Security "restricted" but for the user: the
engine images run as root) and everything it mounts or runs is reserved: users may add, never
replace.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, model_validator

from mooncake_operator.api.base import ApiModel
from mooncake_operator.api.group import OPERATOR_KEY_PREFIX, OPERATOR_LABEL_KEYS
from mooncake_operator.api.kube_types import (
    LABEL_VALUE_RE,
    MULTUS_NETWORKS_ANNOTATION,
    Affinity,
    PodSecurityContext,
    Toleration,
    TopologySpreadConstraint,
    VolumeMount,
    check_metadata_key,
)
from mooncake_operator.api.quantities import Quantity, parse_quantity

# /tmp holds vLLM's torch.compile and Triton caches: a few GiB for a large model, 10Gi leaves headroom.
DEFAULT_SCRATCH_SIZE = "10Gi"
MIN_SCRATCH_BYTES = 1 << 30


class Scheduling(ApiModel):
    """Where pods run: passed to the pod spec unchanged."""

    node_selector: dict[str, str] | None = Field(default=None, description="Pod nodeSelector.")
    tolerations: list[Toleration] | None = Field(default=None, description="Pod tolerations.")
    affinity: Affinity | None = Field(default=None, description="Pod affinity (Kubernetes' shape).")
    topology_spread_constraints: list[TopologySpreadConstraint] | None = Field(
        default=None, description="Pod topologySpreadConstraints."
    )
    priority_class_name: str | None = Field(default=None, min_length=1, description="Pod priorityClassName.")


class ReplicaScheduling(Scheduling):
    replica_anti_affinity: Literal["Preferred", "Required", "None"] | None = Field(
        default=None,
        description=(
            "Anti-affinity between this resource's replicas on kubernetes.io/hostname, added to affinity. "
            "Unset: Preferred (Required with store.rdma.hostNetwork)."
        ),
    )


class PodMetadata(ApiModel):
    """Extra labels and annotations on the replica and master pods (not on the operator's own keys)."""

    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None

    @model_validator(mode="after")
    def _not_the_operators(self) -> PodMetadata:
        for kind, entries in (("labels", self.labels), ("annotations", self.annotations)):
            for key, value in (entries or {}).items():
                field = f"podMetadata.{kind}"
                check_metadata_key(key, field)
                if key in OPERATOR_LABEL_KEYS or key.startswith(OPERATOR_KEY_PREFIX):
                    raise ValueError(f"{field}: {key} is set by the operator and cannot be overridden")
                if kind == "labels" and not LABEL_VALUE_RE.match(value):
                    raise ValueError(
                        f"{field}: the value {value!r} of {key} is not a valid label value (at most 63 "
                        "letters, digits, '-', '_' or '.', starting and ending with a letter or digit)"
                    )
        if self.annotations and MULTUS_NETWORKS_ANNOTATION in self.annotations:
            raise ValueError(
                f"podMetadata.annotations: set {MULTUS_NETWORKS_ANNOTATION} through store.rdma.networks, "
                "which the operator checks against hostNetwork"
            )
        return self


HF_HOME_PATH = "/var/cache/huggingface"
TMP_PATH = "/tmp"
# Volumes and mount paths of the engine container (build.replicas builds them; a test keeps both in step).
RESERVED_VOLUMES = frozenset(
    {"store-config", "dshm", "hf-cache", "hf-token", "tmp", "rdma-devices", "etcd-ca"}
)
RESERVED_MOUNT_PATHS = frozenset(
    {
        "/etc/vllm",
        "/dev/shm",
        HF_HOME_PATH,
        TMP_PATH,
        "/dev/infiniband",
        "/etc/mooncake/etcd-ca",
        "/etc/mooncake/hf-token",
    }
)
ENGINE_CONTAINER_NAME = "vllm"
_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _overlaps_reserved(path: str) -> str | None:
    clean = path.rstrip("/") or "/"
    for reserved in sorted(RESERVED_MOUNT_PATHS):
        if clean == reserved or reserved.startswith(clean.rstrip("/") + "/"):
            return reserved
    return None


def _named(items: list[dict[str, Any]], field: str) -> list[str]:
    names = []
    for item in items:
        name = item.get("name")
        if not isinstance(name, str) or not _DNS_LABEL_RE.match(name) or len(name) > 63:
            raise ValueError(f"{field}: every entry needs a name (a DNS label), got {name!r}")
        names.append(name)
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"{field}: names must be unique; repeated: {', '.join(duplicates)}")
    return names


class ReplicaPodSpec(ApiModel):
    """Settings of the replica pods beyond the engine: security, identity, drain, and what users add."""

    security_context: PodSecurityContext | None = Field(
        default=None,
        description=(
            "The pod's securityContext; each field set here replaces the operator's default "
            "(seccompProfile RuntimeDefault)."
        ),
    )
    service_account_name: str | None = Field(
        default=None,
        min_length=1,
        description=(
            "ServiceAccount of the replica pods, e.g. one bound to an IAM role (IRSA) or a Google service "
            "account (Workload Identity) for weights on S3/GCS. Unset: the namespace's default."
        ),
    )
    automount_service_account_token: bool = Field(
        default=False,
        description=(
            "Mount the ServiceAccount's Kubernetes API token. IRSA and Workload Identity work without it; "
            "set it only for code in the pod that calls the Kubernetes API. Needs serviceAccountName."
        ),
    )
    runtime_class_name: str | None = Field(
        default=None, min_length=1, description="RuntimeClass of the replica pods, e.g. nvidia."
    )
    drain_seconds: int = Field(
        default=300,
        ge=0,
        le=86400,
        description=(
            "On a roll or delete, how long a replica may finish its in-flight requests (preStop: it "
            "leaves the Services first, then waits until vLLM runs none) before it is stopped; the "
            "pod's terminationGracePeriodSeconds is this plus 30 s for the engine's own shutdown."
        ),
    )
    scratch_size: Quantity = Field(
        default=DEFAULT_SCRATCH_SIZE,
        description=(
            "Size limit of the engine's scratch emptyDir at /tmp (compile caches: torch.compile, Triton, "
            "CUDA graphs), also requested as ephemeral-storage so the scheduler reserves it and the "
            "kubelet evicts the pod only when the scratch grows past it. A quantity, at least 1Gi."
        ),
    )
    volumes: list[dict[str, Any]] = Field(
        default_factory=list, description="Extra pod volumes (Kubernetes' Volume shape)."
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list, description="Extra mounts of the engine container (of pod.volumes)."
    )
    sidecars: list[dict[str, Any]] = Field(
        default_factory=list, description="Extra containers next to the engine (Kubernetes' Container shape)."
    )
    init_containers: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Init containers, run before the engine (Kubernetes' Container shape).",
    )

    @model_validator(mode="after")
    def _adds_never_replaces(self) -> ReplicaPodSpec:
        if parse_quantity(self.scratch_size) < MIN_SCRATCH_BYTES:
            raise ValueError(
                f"pod.scratchSize {self.scratch_size}: at least 1Gi (vLLM's compile caches land in /tmp)"
            )
        if self.automount_service_account_token and self.service_account_name is None:
            raise ValueError(
                "pod.automountServiceAccountToken needs pod.serviceAccountName: it would mount the token of "
                "the namespace's default ServiceAccount"
            )
        volumes = _named(self.volumes, "pod.volumes")
        for volume in self.volumes:
            if volume["name"] in RESERVED_VOLUMES:
                raise ValueError(f"pod.volumes: {volume['name']} is a volume the operator manages")
            sources = [key for key in volume if key != "name"]
            if len(sources) != 1:
                raise ValueError(
                    f"pod.volumes {volume['name']}: set exactly one volume source (emptyDir, secret, "
                    f"configMap, persistentVolumeClaim, csi, ...), got {sources or 'none'}"
                )
        paths: set[str] = set()
        for mount in self.volume_mounts:
            if mount.name not in volumes:
                raise ValueError(
                    f"pod.volumeMounts: {mount.name} is not in pod.volumes (the operator's volumes cannot "
                    "be mounted twice)"
                )
            if not mount.mount_path.startswith("/"):
                raise ValueError(f"pod.volumeMounts {mount.name}: mountPath must be absolute")
            reserved = _overlaps_reserved(mount.mount_path)
            if reserved is not None:
                raise ValueError(
                    f"pod.volumeMounts {mount.name}: {mount.mount_path} would cover {reserved}, which the "
                    "operator mounts"
                )
            if mount.mount_path in paths:
                raise ValueError(f"pod.volumeMounts: {mount.mount_path} is mounted twice")
            paths.add(mount.mount_path)
        containers = _named(self.sidecars, "pod.sidecars") + _named(
            self.init_containers, "pod.initContainers"
        )
        if ENGINE_CONTAINER_NAME in containers:
            raise ValueError(
                f"pod.sidecars/pod.initContainers: {ENGINE_CONTAINER_NAME} is the engine container"
            )
        repeated = sorted({name for name in containers if containers.count(name) > 1})
        if repeated:
            raise ValueError(f"pod.sidecars and pod.initContainers share names: {', '.join(repeated)}")
        for field, items in (("pod.sidecars", self.sidecars), ("pod.initContainers", self.init_containers)):
            for container in items:
                if not isinstance(container.get("image"), str) or not container["image"]:
                    raise ValueError(f"{field} {container['name']}: image is required")
                context = container.get("securityContext")
                if isinstance(context, Mapping) and context.get("privileged"):
                    raise ValueError(
                        f"{field} {container['name']}: securityContext.privileged is refused (it would give "
                        "the node to the pod)"
                    )
        return self
