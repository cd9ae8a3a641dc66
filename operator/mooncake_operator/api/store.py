"""spec.store: the shared Mooncake store (segment sizes, protocol, RDMA), its master and, with
highly available masters, the etcd they elect their leader through.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from mooncake_operator.api.base import ApiModel
from mooncake_operator.api.images import ImageReference
from mooncake_operator.api.kube_types import (
    GPU_RESOURCE,
    MULTUS_NETWORKS_ANNOTATION,
    ResourceRequirements,
    multus_network_namespaces,
)
from mooncake_operator.api.quantities import Quantity, StoreSize, parse_store_size
from mooncake_operator.api.replica_pod import Scheduling


class RdmaSpec(ApiModel):
    """What an RDMA-capable replica pod needs (store.protocol rdma)."""

    resource_name: str | None = Field(
        default=None,
        min_length=1,
        description=(
            "Extended resource of the RDMA device plugin requested per replica, e.g. rdma/ib, "
            "rdma/roce_gdr, rdma/hca_shared_devices_a."
        ),
    )
    resource_count: int = Field(default=1, ge=1, description="How many of resourceName per replica.")
    host_devices: bool = Field(
        default=False,
        description=(
            "Mount the node's /dev/infiniband (hostPath). Opening those devices needs a privileged "
            "container; prefer resourceName."
        ),
    )
    memlock: Literal["Wrapper", "Runtime"] = Field(
        default="Wrapper",
        description=(
            "Wrapper: run the engine under `ulimit -l unlimited` (adds SYS_RESOURCE); Runtime: rely on the "
            "container runtime's memlock limit."
        ),
    )
    host_network: bool = Field(
        default=False, description="Run replicas on the node's network (one replica per node)."
    )
    networks: str | None = Field(
        default=None,
        min_length=1,
        description=f"Multus secondary networks: the value of the {MULTUS_NETWORKS_ANNOTATION} annotation.",
    )

    @model_validator(mode="after")
    def _a_device(self) -> RdmaSpec:
        if self.resource_name is None and not self.host_devices:
            raise ValueError(
                "store.rdma needs a device: set store.rdma.resourceName (the RDMA device plugin's resource, "
                "e.g. rdma/ib) or store.rdma.hostDevices: true (/dev/infiniband from the node)"
            )
        if self.host_network and self.networks is not None:
            raise ValueError(
                "store.rdma.networks (Multus) has no effect with store.rdma.hostNetwork: set one of them"
            )
        if self.networks is not None:
            multus_network_namespaces(self.networks)  # its syntax; the namespaces are checked with metadata
        if self.resource_name is not None and self.resource_name == GPU_RESOURCE:
            raise ValueError(f"store.rdma.resourceName must not be {GPU_RESOURCE}")
        return self


# The operator-run etcd's default image (etcd's own release image; the binary is on its PATH).
DEFAULT_ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
# host:port of an etcd client endpoint, without a scheme: `tls` decides between http and https.
_ETCD_ENDPOINT_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?:[0-9]{1,5}$")


def _check_etcd_endpoint(value: str) -> str:
    if _ETCD_ENDPOINT_RE.match(value) is None or not 1 <= int(value.rsplit(":", 1)[1]) <= 65535:
        raise ValueError(
            f"etcd endpoint {value!r} must be host:port without a scheme, e.g. etcd-0.etcd.infra.svc:2379 "
            "(set etcd.external.tls for https)"
        )
    return value


EtcdEndpoint = Annotated[str, AfterValidator(_check_etcd_endpoint)]


class EtcdCaSecretRef(ApiModel):
    """The Secret key holding the PEM CA certificate that signed the etcd server's certificate."""

    name: str = Field(min_length=1, description="Name of the Secret (in the resource's namespace).")
    key: str = Field(default="ca.crt", min_length=1, description="Key of the PEM CA certificate.")


class EtcdTls(ApiModel):
    """https to a user-provided etcd. The pinned Mooncake verifies the server against this CA; it cannot
    present a client certificate, so etcd must not require one (no --client-cert-auth)."""

    ca_secret_ref: EtcdCaSecretRef = Field(description="CA certificate of the etcd server.")


class ExternalEtcd(ApiModel):
    endpoints: list[EtcdEndpoint] = Field(
        min_length=1, description="etcd client endpoints, host:port each (e.g. etcd-0.etcd.infra.svc:2379)."
    )
    tls: EtcdTls | None = Field(default=None, description="Connect with https, verifying this CA.")


class ManagedEtcd(ApiModel):
    """An etcd the operator runs for this resource: a StatefulSet with a volume per member."""

    image: ImageReference = Field(
        default=DEFAULT_ETCD_IMAGE, min_length=1, description="etcd image (etcd on PATH)."
    )
    replicas: int = Field(default=1, ge=1, le=5, description="etcd members: 1, 3 or 5.")
    storage_size: Quantity = Field(default="1Gi", description="PersistentVolumeClaim size per member.")
    storage_class_name: str | None = Field(
        default=None,
        min_length=1,
        description="StorageClass of the members' claims (cluster default if unset).",
    )
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)

    @model_validator(mode="after")
    def _odd_members(self) -> ManagedEtcd:
        if self.replicas % 2 == 0:
            raise ValueError(
                f"etcd.managed.replicas must be odd (1, 3 or 5), got {self.replicas}: an even member count "
                "tolerates no more failures than the odd count below it"
            )
        return self


class EtcdSpec(ApiModel):
    """Where the masters elect their leader: an etcd you run (`external`) or one the operator runs
    (`managed`, the default when neither is set)."""

    external: ExternalEtcd | None = Field(default=None, description="A user-provided etcd.")
    managed: ManagedEtcd | None = Field(default=None, description="An etcd the operator runs.")

    @model_validator(mode="after")
    def _one_kind(self) -> EtcdSpec:
        if self.external is not None and self.managed is not None:
            raise ValueError(
                "store.master.highAvailability.etcd: set either external (your etcd) or managed (one the "
                "operator runs), not both"
            )
        return self

    def managed_or_default(self) -> ManagedEtcd | None:
        """The managed etcd's settings, or None when the user provides etcd."""
        if self.external is not None:
            return None
        return self.managed or ManagedEtcd()


class MasterHighAvailability(ApiModel):
    """Several mooncake_master processes, one leader elected through etcd; store clients follow it."""

    enabled: bool = Field(default=False, description="Run several masters with leader election.")
    replicas: int = Field(
        default=3, ge=2, le=7, description="Number of masters (one leader, the rest standby)."
    )
    enable_oplog: bool = Field(
        default=True,
        description=(
            "Replicate the leader's metadata to the standbys through etcd (-enable_oplog). Without it a new "
            "leader starts empty: every prefix stored before the failover is lost to the replicas."
        ),
    )
    etcd: EtcdSpec = Field(default_factory=EtcdSpec, description="The etcd the masters elect through.")


class MasterSpec(ApiModel):
    image: ImageReference | None = Field(
        default=None,
        min_length=1,
        description="Image with mooncake_master; default engine.image (it carries mooncake-transfer-engine).",
    )
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    rpc_port: int = Field(default=50051, ge=1, le=65535)
    metrics_port: int = Field(default=9003, ge=1, le=65535)
    high_availability: MasterHighAvailability = Field(
        default_factory=MasterHighAvailability,
        description="Several masters with leader election through etcd (off by default).",
    )
    scheduling: Scheduling | None = Field(default=None, description="Where the master pod runs.")
    client_ttl_seconds: int | None = Field(
        default=None,
        ge=1,
        le=3600,
        description=(
            "mooncake_master -client_ttl: seconds a store client (a replica's worker) stays mounted without "
            "a heartbeat. Unset: Mooncake's default (10 s). Raise it where busy engines can miss "
            "heartbeats (CPU-starved nodes): an unmounted live replica's blocks fail every load. The price: "
            "a crashed replica's segment stays mounted, and receives blocks, that long."
        ),
    )
    kv_lease_ttl_seconds: int | None = Field(
        default=None,
        ge=1,
        le=3600,
        description=(
            "mooncake_master -default_kv_lease_ttl: seconds a reader's lease keeps a block from eviction "
            "while it transfers it. Unset: Mooncake's default (10 s). A transfer slower than this fails, "
            "and vLLM answers that request with HTTP 500. Raise it where transfers can stall (CPU-starved "
            "nodes, TCP under load); leased blocks cannot be evicted meanwhile."
        ),
    )

    @model_validator(mode="after")
    def _distinct_ports(self) -> MasterSpec:
        if self.rpc_port == self.metrics_port:
            raise ValueError(f"store.master: rpcPort and metricsPort must differ (both {self.rpc_port})")
        return self


class StoreSpec(ApiModel):
    mode: Literal["embedded"] = Field(
        default="embedded", description="embedded: every tensor-parallel worker contributes a segment."
    )
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = Field(default="", description="RDMA device(s), e.g. 'mlx5_0'; required for rdma.")
    global_segment_size: StoreSize | None = Field(
        default=None,
        description="Memory each tensor-parallel worker contributes to the shared pool, e.g. '80GB'.",
    )
    local_buffer_size: StoreSize = Field(default="4GB", description="Per-worker transfer buffer, e.g. '4GB'.")
    enable_offload: bool = False
    load_async: bool = Field(default=True, description="kv_connector_extra_config.load_async.")
    isolate_revisions: bool = Field(
        default=True,
        description=(
            "Give replicas a store key namespace per KV-compatibility fingerprint (model and tokenizer "
            "revision, engine image, block size, tensor parallelism, hash seed, draft model, KV-shaping "
            "extraArgs) through kv_connector_extra_config.cache_prefix, so a new revision never reads "
            "blocks an old one stored. Turn off only to reproduce the hazard or to debug."
        ),
    )
    load_failure_policy: Literal["fail", "recompute"] = Field(
        default="fail",
        description=(
            "kv_load_failure_policy in --kv-transfer-config (rendered explicitly): what a replica does when "
            "loading a prefix from the store fails. fail (vLLM's default): the request fails. recompute "
            "(opt-in): the replica computes the prefix itself; the failed load stays counted as an "
            "external hit, and the canary judges a pair whose warm request saw a failed store load "
            "Inconclusive."
        ),
    )
    metadata_server: Literal["P2PHANDSHAKE"] = "P2PHANDSHAKE"
    master: MasterSpec = Field(default_factory=MasterSpec)
    rdma: RdmaSpec | None = Field(default=None, description="What replica pods need for protocol rdma.")

    @model_validator(mode="after")
    def _consistent(self) -> StoreSpec:
        if self.mode == "embedded" and (
            self.global_segment_size is None or parse_store_size(self.global_segment_size) == 0
        ):
            raise ValueError(
                "store.mode embedded needs store.globalSegmentSize > 0 (the memory each tensor-parallel "
                'worker contributes to the shared pool), e.g. "80GB"'
            )
        if parse_store_size(self.local_buffer_size) == 0:
            raise ValueError('store.localBufferSize must be greater than zero, e.g. "4GB"')
        if self.protocol == "rdma" and not self.device_name.strip():
            raise ValueError("store.protocol rdma needs store.deviceName (the RDMA device, e.g. mlx5_0)")
        if self.protocol == "rdma" and self.rdma is None:
            raise ValueError(
                "store.protocol rdma needs store.rdma with a device: store.rdma.resourceName (e.g. rdma/ib) "
                "or store.rdma.hostDevices: true; without one the pods cannot open the RDMA device"
            )
        if self.protocol != "rdma" and self.rdma is not None:
            raise ValueError(f"store.rdma is set but store.protocol is {self.protocol}: set protocol rdma")
        return self

    def segment_bytes(self) -> int:
        return parse_store_size(self.global_segment_size) if self.global_segment_size else 0

    def local_buffer_bytes(self) -> int:
        return parse_store_size(self.local_buffer_size)
