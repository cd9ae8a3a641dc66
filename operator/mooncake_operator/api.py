"""The MooncakeServing API: pydantic models of spec and status, the single source of truth.

The CRD schema (`mooncake_operator.crd`), the renderer and the engine command line are all derived from
these models. Fields are snake_case in Python and camelCase on the wire; unknown fields are rejected so a
typo in a manifest is an error, not a silently ignored setting. Every cross-field rule lives in a model
validator here, so an invalid resource is rejected whole before anything is rendered or applied.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from mooncake_operator.canary.expectations import Expectation
from mooncake_operator.canary.models import (
    MAX_SUITE_REQUESTS,
    SUITE_NAME_PATTERN,
    Mismatch,
    Verdict,
    check_chat_request,
)
from mooncake_operator.canary_defaults import (
    DEFAULT_MAX_DRIFT_NATS,
    DEFAULT_MAX_TIE_GAP_NATS,
    DEFAULT_TOP_K,
    MAX_BODY_BYTES_LIMIT,
    MAX_TOP_K,
)

GROUP = "serving.mooncake-operator.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "MooncakeServing"
PLURAL = "mooncakeservings"
SINGULAR = "mooncakeserving"
SHORT_NAMES = ("mcs",)
# Names the operator writes into objects, so users and tests can rely on them: the field manager of every
# server-side apply, and the annotation a user sets to any new value to re-run the canary (after a
# rollback: to retry the spec). An older operator put LEGACY_FINALIZER on every resource; this one
# removes it (kopf does, as no handler needs a finalizer).
FIELD_MANAGER = "mooncake-operator"
LEGACY_FINALIZER = f"{GROUP}/finalizer"
RERUN_CANARY_ANNOTATION = f"{GROUP}/rerun-canary"

GPU_RESOURCE = "nvidia.com/gpu"
# Children are named "<name>-store-config", "<name>-replica-<ordinal>" ...; a StatefulSet's pods carry a
# "controller-revision-hash" label of "<statefulset>-<10 chars>", which must fit in 63 characters.
MAX_NAME_LENGTH = 40
# Replicas of one model sharing one store. 64 replicas of a TP-8 model are 512 GPUs behind one Mooncake
# master; the canary proves them as a ring, one pair at a time (2 chat requests each), so a full run stays
# in minutes, and the operator's per-replica Services and reads stay small. Beyond that, shard into
# several MooncakeServings (each its own store); raise it here, with a measurement, if a user needs more.
MAX_REPLICAS = 64
# Foreign pods in the client Service named in status.foreignPods and events: the first this many found.
MAX_FOREIGN_PODS = 8
# Largest byte count a size or quantity may state: 2**63 - 1 (Kubernetes quantities are int64 too), so
# arithmetic on it stays exact and every digit string stays far below Python's int/str conversion limit.
MAX_BYTES = 2**63 - 1


# --- sizes -------------------------------------------------------------------------------------------

# Mooncake store sizes use the grammar vLLM's MooncakeStoreConfig parses: a number and an optional unit
# GB/MB/KB/B, case-insensitive, binary multiples (1GB = 1024**3 bytes). We accept exactly that grammar, so
# every value we write into mooncake_store.json is one the engine reads the same way.
_STORE_SIZE_UNITS = {"gb": 1024**3, "mb": 1024**2, "kb": 1024, "b": 1, "": 1}
_STORE_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(gb|mb|kb|b)?\s*$", re.IGNORECASE)


def parse_store_size(value: str) -> int:
    """Bytes of a Mooncake store size ("80GB", "4GB", "512MB"; binary units, as Mooncake reads them)."""
    match = _STORE_SIZE_RE.match(value)
    if match is None:
        raise ValueError(
            f"cannot parse size {value!r}: write a number and one of the units GB, MB, KB or B "
            '(binary, as Mooncake reads them: "80GB" is 80 * 1024**3 bytes), e.g. "80GB" or "512MB"'
        )
    number, unit = match.group(1), (match.group(2) or "").lower()
    if len(number) > 40:  # 40 digits already exceed MAX_BYTES; longer ones are refused unparsed
        raise ValueError(f"size {value[:40]!r}... is too large (at most {MAX_BYTES} bytes)")
    size = Decimal(number) * _STORE_SIZE_UNITS[unit]
    if size > MAX_BYTES:
        raise ValueError(f"size {value!r} is too large (at most {MAX_BYTES} bytes)")
    return int(size)


def _check_store_size(value: str) -> str:
    parse_store_size(value)
    return value


# The pattern goes into the CRD only, so pydantic reports the friendlier message of `parse_store_size`.
STORE_SIZE_PATTERN = r"^\s*[0-9]+(\.[0-9]+)?\s*([gGmMkK]?[bB])?\s*$"
StoreSize = Annotated[
    str,
    AfterValidator(_check_store_size),
    Field(json_schema_extra={"pattern": STORE_SIZE_PATTERN}),
]

# Kubernetes resource quantities ("64Gi", "500m", "4"): resource.Quantity's grammar.
_QUANTITY_RE = re.compile(
    r"^(?P<number>[+-]?(?:\d+(?:\.\d*)?|\.\d+))(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$"
)
_BINARY_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL_SUFFIXES = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}


def parse_quantity(value: str | int) -> Decimal:
    """The numeric value of a Kubernetes quantity ("64Gi" -> 68719476736, "500m" -> 0.5)."""
    text = str(value).strip()
    shown = text if len(text) <= 40 else text[:40] + "..."
    if len(text) > 60:  # no quantity up to MAX_BYTES needs more characters
        raise ValueError(f"quantity {shown!r} is too large (at most {MAX_BYTES})")
    match = _QUANTITY_RE.match(text)
    if match is None:
        raise ValueError(
            f"cannot parse quantity {value!r}: use a Kubernetes quantity such as '64Gi', '4' or '500m'"
        )
    number = Decimal(match.group("number"))
    suffix = match.group("suffix") or ""
    try:
        if suffix in _BINARY_SUFFIXES:
            amount = number * _BINARY_SUFFIXES[suffix]
        elif suffix in _DECIMAL_SUFFIXES:
            amount = number * _DECIMAL_SUFFIXES[suffix]
        else:
            amount = number * Decimal(10) ** int(suffix[1:])
    except ArithmeticError as error:  # decimal.Overflow: an exponent like 1e999999999
        raise ValueError(f"quantity {shown!r} is too large (at most {MAX_BYTES})") from error
    if abs(amount) > MAX_BYTES:
        raise ValueError(f"quantity {shown!r} is too large (at most {MAX_BYTES})")
    return amount


def _check_quantity(value: str | int) -> str | int:
    if parse_quantity(value) < 0:
        raise ValueError(f"quantity {value!r} must not be negative")
    return value


Quantity = Annotated[str | int, AfterValidator(_check_quantity)]


# --- base ----------------------------------------------------------------------------------------------


class ApiModel(BaseModel):
    """Frozen, camelCase on the wire, unknown fields rejected, no type coercion (as the API server)."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        strict=True,
        populate_by_name=True,
        alias_generator=to_camel,
        validate_default=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The JSON-compatible wire form (camelCase keys, unset optional fields left out)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# --- pods on a real cluster: scheduling, metadata, storage, RDMA, network policy (issue 10) -------------
#
# Kubernetes' own shapes (field names, enums, nesting), typed so the generated CRD validates them and the
# renderer passes them through unchanged (`to_wire()` leaves unset fields out). Affinity is deep but not
# recursive, so it is typed all the way down: the CRD stays structural and the API server checks it.

# Labels and annotations the operator sets on its pods; spec.podMetadata may not touch them.
OPERATOR_LABEL_KEYS = frozenset(
    {
        "app.kubernetes.io/name",
        "app.kubernetes.io/instance",
        "app.kubernetes.io/component",
        "app.kubernetes.io/part-of",
        "app.kubernetes.io/managed-by",
    }
)
OPERATOR_KEY_PREFIX = f"{GROUP}/"  # traffic label, config-hash and applied-hash annotations, ...
MULTUS_NETWORKS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"
HOSTNAME_TOPOLOGY_KEY = "kubernetes.io/hostname"

# Kubernetes' qualified-name grammar (label and annotation keys) and label-value grammar.
_NAME_PART = r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]"
_DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_QUALIFIED_NAME_RE = re.compile(rf"^({_DNS_SUBDOMAIN}/)?{_NAME_PART}$")
_LABEL_VALUE_RE = re.compile(rf"^({_NAME_PART})?$")


def _check_metadata_key(key: str, field: str) -> None:
    prefix = key.rsplit("/", 1)[0] if "/" in key else ""
    if not _QUALIFIED_NAME_RE.match(key) or len(prefix) > 253:
        raise ValueError(
            f"{field}: {key!r} is not a valid key (an optional DNS-subdomain prefix and '/', then at most 63 "
            "letters, digits, '-', '_' or '.', starting and ending with a letter or digit)"
        )


class LabelSelectorRequirement(ApiModel):
    key: str = Field(min_length=1)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] | None = None


class LabelSelector(ApiModel):
    """metav1.LabelSelector. An empty selector ({}) selects everything."""

    match_labels: dict[str, str] | None = None
    match_expressions: list[LabelSelectorRequirement] | None = None

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether pods with `labels` are selected (Kubernetes' semantics)."""
        if any(labels.get(key) != value for key, value in (self.match_labels or {}).items()):
            return False
        for requirement in self.match_expressions or []:
            present = requirement.key in labels
            value = labels.get(requirement.key)
            chosen = requirement.values or []
            if requirement.operator == "In" and not (present and value in chosen):
                return False
            if requirement.operator == "NotIn" and present and value in chosen:
                return False
            if requirement.operator == "Exists" and not present:
                return False
            if requirement.operator == "DoesNotExist" and present:
                return False
        return True


class Toleration(ApiModel):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class NodeSelectorRequirement(ApiModel):
    key: str = Field(min_length=1)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
    values: list[str] | None = None


class NodeSelectorTerm(ApiModel):
    match_expressions: list[NodeSelectorRequirement] | None = None
    match_fields: list[NodeSelectorRequirement] | None = None


class NodeSelector(ApiModel):
    node_selector_terms: list[NodeSelectorTerm]


class PreferredSchedulingTerm(ApiModel):
    weight: int = Field(ge=1, le=100)
    preference: NodeSelectorTerm


class NodeAffinity(ApiModel):
    required_during_scheduling_ignored_during_execution: NodeSelector | None = None
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] | None = None


class PodAffinityTerm(ApiModel):
    label_selector: LabelSelector | None = None
    namespaces: list[str] | None = None
    namespace_selector: LabelSelector | None = None
    topology_key: str = Field(min_length=1)


class WeightedPodAffinityTerm(ApiModel):
    weight: int = Field(ge=1, le=100)
    pod_affinity_term: PodAffinityTerm


class PodAffinity(ApiModel):
    """podAffinity and podAntiAffinity share this shape."""

    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] | None = None
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] | None = None


class Affinity(ApiModel):
    node_affinity: NodeAffinity | None = None
    pod_affinity: PodAffinity | None = None
    pod_anti_affinity: PodAffinity | None = None


class TopologySpreadConstraint(ApiModel):
    max_skew: int = Field(ge=1)
    topology_key: str = Field(min_length=1)
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"]
    label_selector: LabelSelector | None = None
    min_domains: int | None = Field(default=None, ge=1)


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


class LocalObjectReference(ApiModel):
    name: str = Field(min_length=1)


class PodMetadata(ApiModel):
    """Extra labels and annotations on the replica and master pods (not on the operator's own keys)."""

    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None

    @model_validator(mode="after")
    def _not_the_operators(self) -> PodMetadata:
        for kind, entries in (("labels", self.labels), ("annotations", self.annotations)):
            for key, value in (entries or {}).items():
                field = f"podMetadata.{kind}"
                _check_metadata_key(key, field)
                if key in OPERATOR_LABEL_KEYS or key.startswith(OPERATOR_KEY_PREFIX):
                    raise ValueError(f"{field}: {key} is set by the operator and cannot be overridden")
                if kind == "labels" and not _LABEL_VALUE_RE.match(value):
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


class CacheClaimTemplate(ApiModel):
    """One PersistentVolumeClaim per replica (the StatefulSet's volumeClaimTemplates), ReadWriteOnce."""

    size: Quantity = Field(description="Requested storage, e.g. '600Gi'.")
    storage_class_name: str | None = Field(
        default=None, min_length=1, description="StorageClass; unset: the cluster's default class."
    )

    @model_validator(mode="after")
    def _positive(self) -> CacheClaimTemplate:
        if parse_quantity(self.size) <= 0:
            raise ValueError("model.cache.volumeClaimTemplate.size must be greater than zero, e.g. '600Gi'")
        return self


def multus_network_namespaces(value: str) -> list[str]:
    """The namespaces named in a Multus networks annotation value (`[ns/]name[@iface]`, comma-separated,
    or a JSON list of objects with an optional `namespace`); raises ValueError when it is neither."""
    text = value.strip()
    if text.startswith("["):
        try:
            entries = json.loads(text)
        except ValueError as error:
            raise ValueError(f"store.rdma.networks is not a valid JSON list: {error}") from error
        if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
            raise ValueError("store.rdma.networks: a JSON value must be a list of objects")
        namespaces = []
        for entry in entries:
            namespace = entry.get("namespace")
            if namespace is not None:
                if not isinstance(namespace, str):
                    raise ValueError("store.rdma.networks: a namespace must be a string")
                namespaces.append(namespace)
        return namespaces
    namespaces = []
    for entry in text.split(","):
        namespace, slash, _ = entry.strip().partition("/")
        if slash:
            namespaces.append(namespace)
    return namespaces


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


class IPBlock(ApiModel):
    cidr: str = Field(min_length=1)
    except_: list[str] | None = Field(default=None, alias="except")


class NetworkPolicyPeer(ApiModel):
    """networking.k8s.io/v1 NetworkPolicyPeer."""

    pod_selector: LabelSelector | None = None
    namespace_selector: LabelSelector | None = None
    ip_block: IPBlock | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> NetworkPolicyPeer:
        selectors = self.pod_selector is not None or self.namespace_selector is not None
        if self.ip_block is not None and selectors:
            raise ValueError("a network peer has either ipBlock or podSelector/namespaceSelector, not both")
        if self.ip_block is None and not selectors:
            raise ValueError("a network peer needs podSelector, namespaceSelector or ipBlock")
        return self


class NetworkPolicyPort(ApiModel):
    protocol: Literal["TCP", "UDP", "SCTP"] = "TCP"
    port: int = Field(ge=1, le=65535)


class EgressRule(ApiModel):
    """networking.k8s.io/v1 NetworkPolicyEgressRule: to these peers, on these ports (unset: any)."""

    to: list[NetworkPolicyPeer] = Field(min_length=1)
    ports: list[NetworkPolicyPort] | None = Field(default=None, min_length=1)


class EgressSpec(ApiModel):
    """Where the replicas may connect (set: nowhere else)."""

    dns: list[NetworkPolicyPeer] | None = Field(
        default=None,
        min_length=1,
        description=(
            "The cluster's DNS servers (port 53, UDP and TCP). Unset: pods labelled k8s-app=kube-dns in "
            "namespace kube-system."
        ),
    )
    to: list[EgressRule] = Field(
        default_factory=list,
        description=(
            "More destinations: a model hub or mirror, an external etcd, a tracing collector. The store's "
            "peers (this resource's replicas), its masters and a managed etcd are always allowed."
        ),
    )


class NetworkPolicySpec(ApiModel):
    enabled: bool = Field(default=True, description="Render the NetworkPolicies of master and replicas.")
    operator: NetworkPolicyPeer | None = Field(
        default=None,
        description=(
            "Who the operator is (it runs the canary against the replicas' HTTP port). Unset: pods "
            "labelled app.kubernetes.io/name=mooncake-operator in the operator's own namespace."
        ),
    )
    clients: list[NetworkPolicyPeer] | None = Field(
        default=None,
        description=(
            "Who may call the replicas' HTTP port, besides the operator. Unset: anyone, or only the "
            "operator where it runs with --replica-ingress-default=listed-clients."
        ),
    )
    egress: EgressSpec | None = Field(
        default=None,
        description=(
            "Restrict the replicas' egress to DNS, the store (replicas, masters, managed etcd) and "
            "egress.to. Unset: egress is not restricted."
        ),
    )
    metrics_scrapers: list[NetworkPolicyPeer] = Field(
        default_factory=list,
        description=(
            "Admits nobody: the master's metrics port also serves its unauthenticated admin API "
            "(remove_all, quotas, drains), so no scraper is let in. Kept so existing resources stay valid."
        ),
    )


class EnvKeySelector(ApiModel):
    name: str = Field(min_length=1, description="Name of the Secret or ConfigMap.")
    key: str = Field(min_length=1)
    optional: bool | None = None


class EnvVarSource(ApiModel):
    secret_key_ref: EnvKeySelector | None = None
    config_map_key_ref: EnvKeySelector | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> EnvVarSource:
        if (self.secret_key_ref is None) == (self.config_map_key_ref is None):
            raise ValueError("valueFrom needs exactly one of secretKeyRef and configMapKeyRef")
        return self


# --- engine flags as vLLM's parser reads them ---------------------------------------------------------

# Every option string of a managed flag in the pinned vLLM (0.32.0's `vllm serve` parser; aliases such as
# -tp, -sc and --no-trust-remote-code included) and the field it comes from.
MANAGED_ENGINE_FLAGS = {
    "--model": "model.name",
    "--revision": "model.revision",
    "--tokenizer-revision": "model.tokenizerRevision",
    "--trust-remote-code": "model.trustRemoteCode",
    "--no-trust-remote-code": "model.trustRemoteCode",
    "--max-model-len": "model.maxModelLen",
    "--tensor-parallel-size": "engine.tensorParallelSize",
    "-tp": "engine.tensorParallelSize",
    "--block-size": "engine.blockSize",
    "--kv-transfer-config": "store",
    "--speculative-config": "speculative",
    "-sc": "speculative",
    "--host": "(managed by the operator)",
    "--port": "engine.port",
    "--served-model-name": "model.name",
    # A config file can set every flag, managed ones included.
    "--config": "(a config file could set managed flags; use the typed fields and extraArgs)",
}
# vLLM options that are themselves a prefix of a managed option: exact matches win over abbreviations.
_EXACT_OPTIONS_PREFIXING_MANAGED = frozenset({"--tokenizer"})


def engine_flag(arg: str) -> str | None:
    """The option an extraArgs item names, as vLLM's FlexibleArgumentParser reads it, or None for a value.

    It splits `--flag=value`, turns underscores into dashes between `--` and the first `.`, and treats
    `--flag.sub.key` (and `-x.sub`) as a part of the JSON option `--flag`.
    """
    if not arg.startswith("-") or arg in ("-", "--") or re.match(r"^-[0-9.]", arg):
        return None
    head = arg.split("=", 1)[0]
    if head.startswith("--"):
        first = head[2:].split(".", 1)[0]
        return "--" + first.replace("_", "-")
    return head.split(".", 1)[0]


def managed_flag_of(arg: str) -> tuple[str, str] | None:
    """(managed option, its field) when `arg` sets a managed flag in any spelling vLLM accepts."""
    flag = engine_flag(arg)
    if flag is None:
        return None
    if flag in MANAGED_ENGINE_FLAGS:
        return flag, MANAGED_ENGINE_FLAGS[flag]
    # argparse's allow_abbrev is on in vLLM's parsers: an unambiguous prefix means the whole option.
    if flag not in _EXACT_OPTIONS_PREFIXING_MANAGED:
        for option, source in MANAGED_ENGINE_FLAGS.items():
            same_dashes = option.startswith("--") == flag.startswith("--")
            if same_dashes and len(flag) >= 2 and option.startswith(flag):
                return option, source
    return None


# Options whose value is a secret: extraArgs are kept in the last-good record (a ConfigMap) and the pod
# spec, both readable by far more people than a Secret. Each with its shortest spelling we treat as it
# (argparse accepts unambiguous prefixes; shorter ones are ambiguous in vLLM and refused by it).
SECRET_ENGINE_FLAGS = {
    "--hf-token": ("--hf-t", "model.hfTokenSecretRef (a Secret the engine reads as a file)"),
    "--api-key": ("--api-k", "engine.extraEnv VLLM_API_KEY with valueFrom.secretKeyRef"),
}


def secret_flag_of(arg: str) -> tuple[str, str] | None:
    """(option, where the secret belongs instead) when `arg` passes a secret on the command line."""
    flag = engine_flag(arg)
    if flag is None:
        return None
    for option, (shortest, instead) in SECRET_ENGINE_FLAGS.items():
        if flag.startswith(shortest) and option.startswith(flag):
            return option, instead
    return None


# Counted into the GPU request (a worker per GPU); data parallelism is refused (see EngineSpec).
PIPELINE_PARALLEL_OPTIONS = ("--pipeline-parallel-size", "-pp")
DEFAULT_GPUS_PER_NODE = 8


def _is_pipeline_parallel(flag: str) -> bool:
    if flag == "-pp":
        return True
    # argparse abbreviations: vLLM has no other option starting with --pipe.
    return flag.startswith("--pipe") and PIPELINE_PARALLEL_OPTIONS[0].startswith(flag)


def _is_data_parallel(flag: str) -> bool:
    """-dp and every --data-parallel-* option (and their abbreviations, -dpl, -dpr, ...)."""
    if flag.startswith("-dp") and not flag.startswith("--"):
        return True
    return flag.startswith("--data-parallel") or (
        len(flag) > len("--dat") and "--data-parallel".startswith(flag)
    )


def _pipeline_parallel_size(extra_args: Sequence[str]) -> int:
    size = 1
    for index, arg in enumerate(extra_args):
        flag = engine_flag(arg)
        if flag is None or not _is_pipeline_parallel(flag):
            continue
        if "=" in arg:
            value: str | None = arg.split("=", 1)[1]
        else:
            value = extra_args[index + 1] if index + 1 < len(extra_args) else None
        if value is None or not re.fullmatch(r"[0-9]+", value) or int(value) < 1:
            raise ValueError(
                f"engine.extraArgs: {flag} needs a positive whole number of pipeline stages, got {value!r}"
            )
        size = int(value)
    return size


# --- engine pods: security, identity, graceful drain, escape hatches (issue 24) --------------------------
#
# Kubernetes' own shapes. The operator sets hardened defaults (Pod Security "restricted" but for the user:
# the engine images run as root) and everything it mounts or runs is reserved: extra volumes, mounts,
# sidecars and init containers may add, never replace.

HF_HOME_PATH = "/var/cache/huggingface"
TMP_PATH = "/tmp"
# Volumes and mount paths of the engine container (render.py builds them; a unit test keeps both in step).
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


class Capabilities(ApiModel):
    add: list[str] | None = None
    drop: list[str] | None = None


class SeccompProfile(ApiModel):
    type: Literal["RuntimeDefault", "Localhost", "Unconfined"]
    localhost_profile: str | None = Field(default=None, min_length=1)


class ContainerSecurityContext(ApiModel):
    """Kubernetes' container securityContext, without `privileged` (only store.rdma.hostDevices sets it)."""

    run_as_user: int | None = Field(default=None, ge=0)
    run_as_group: int | None = Field(default=None, ge=0)
    run_as_non_root: bool | None = None
    read_only_root_filesystem: bool | None = None
    allow_privilege_escalation: bool | None = None
    capabilities: Capabilities | None = None
    seccomp_profile: SeccompProfile | None = None


class PodSecurityContext(ApiModel):
    run_as_user: int | None = Field(default=None, ge=0)
    run_as_group: int | None = Field(default=None, ge=0)
    run_as_non_root: bool | None = None
    fs_group: int | None = Field(default=None, ge=0)
    fs_group_change_policy: Literal["Always", "OnRootMismatch"] | None = None
    supplemental_groups: list[int] | None = None
    seccomp_profile: SeccompProfile | None = None


class VolumeMount(ApiModel):
    name: str = Field(min_length=1)
    mount_path: str = Field(min_length=1)
    sub_path: str | None = Field(default=None, min_length=1)
    read_only: bool | None = None


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


# --- spec ----------------------------------------------------------------------------------------------


class SecretKeyRef(ApiModel):
    """A key in a Secret in the resource's namespace."""

    name: str = Field(min_length=1, description="Name of the Secret.")
    key: str = Field(default="token", min_length=1, description="Key within the Secret.")


class ModelCache(ApiModel):
    """Where the Hugging Face cache (model and draft weights) lives on each replica.

    Either an existing PersistentVolumeClaim (shared, ReadWriteMany, so weights download once) or an
    ephemeral emptyDir per pod (the default; weights download on every pod start).
    """

    existing_claim: str | None = Field(
        default=None,
        min_length=1,
        description="Name of an existing PersistentVolumeClaim mounted as the Hugging Face cache.",
    )
    ephemeral_size: Quantity | None = Field(
        default=None,
        description=(
            "Size limit of the per-pod emptyDir cache, e.g. '500Gi', also requested as ephemeral-storage. "
            "Only without existingClaim."
        ),
    )
    volume_claim_template: CacheClaimTemplate | None = Field(
        default=None,
        description="A ReadWriteOnce PersistentVolumeClaim per replica (recommended for production).",
    )

    @model_validator(mode="after")
    def _one_kind(self) -> ModelCache:
        chosen = [
            name
            for name, value in (
                ("existingClaim", self.existing_claim),
                ("ephemeralSize", self.ephemeral_size),
                ("volumeClaimTemplate", self.volume_claim_template),
            )
            if value is not None
        ]
        if len(chosen) > 1:
            raise ValueError(
                "model.cache: set either existingClaim (a PersistentVolumeClaim) or ephemeralSize "
                "(a per-pod emptyDir) or volumeClaimTemplate (a claim per replica), not both: "
                + " and ".join(chosen)
            )
        return self


class ModelSpec(ApiModel):
    name: str = Field(
        min_length=1,
        description="Hugging Face model id served by every replica, e.g. MiniMaxAI/MiniMax-M2.5.",
    )
    revision: str | None = Field(
        default=None,
        min_length=1,
        description="Hugging Face revision of the weights. Pin a commit: replicas must load equal weights.",
    )
    tokenizer_revision: str | None = Field(
        default=None, min_length=1, description="Hugging Face revision of the tokenizer."
    )
    trust_remote_code: bool = Field(default=False, description="Pass --trust-remote-code.")
    max_model_len: int | None = Field(default=None, ge=1, description="Pass --max-model-len.")
    cache: ModelCache = Field(default_factory=ModelCache, description="Hugging Face cache volume.")
    hf_token_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description=(
            "Secret key holding the Hugging Face token, mounted as a file the engine reads through "
            "HF_TOKEN_PATH. Never inline a token."
        ),
    )
    served_model_name_aliases: list[str] = Field(
        default_factory=list,
        description=(
            "More names the replicas answer to (--served-model-name NAME ALIAS...). model.name stays the "
            "first served name: the canary and /v1/models use it."
        ),
    )

    @model_validator(mode="after")
    def _aliases_distinct(self) -> ModelSpec:
        seen = {self.name}
        for alias in self.served_model_name_aliases:
            if not alias.strip() or alias != alias.strip():
                raise ValueError(
                    f"model.servedModelNameAliases: {alias!r} must be a non-empty name without surrounding "
                    "spaces"
                )
            if alias in seen:
                raise ValueError(
                    f"model.servedModelNameAliases: {alias!r} is listed twice (model.name is always served)"
                )
            seen.add(alias)
        return self


class EnvVar(ApiModel):
    """A literal value, or a reference to a Secret or ConfigMap key (the value never enters the spec)."""

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    value: str | None = None
    value_from: EnvVarSource | None = None

    @model_validator(mode="after")
    def _value_or_reference(self) -> EnvVar:
        if (self.value is None) == (self.value_from is None):
            raise ValueError(f"engine.extraEnv {self.name}: set exactly one of value and valueFrom")
        return self


class ResourceRequirements(ApiModel):
    """Kubernetes resource requests and limits (quantities as strings or integers)."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)


# Environment that the operator sets itself.
MANAGED_ENV = {
    "PYTHONHASHSEED": "engine.pythonHashSeed",
    "MOONCAKE_CONFIG_PATH": "store",
    "HF_TOKEN": "model.hfTokenSecretRef",
    "HF_TOKEN_PATH": "model.hfTokenSecretRef",
    "HF_HOME": "model.cache",
    "MC_STORE_CLUSTER_ID": "store.master.highAvailability",
    "SSL_CERT_DIR": "store.master.highAvailability.etcd.external.tls",
    "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "the pod's IP (status.podIP), the store client's address",
    "XDG_CACHE_HOME": "the writable /tmp volume (the root filesystem may be read-only)",
    "TRITON_CACHE_DIR": "the writable /tmp volume (the root filesystem may be read-only)",
}


class EngineSpec(ApiModel):
    image: str = Field(
        min_length=1,
        description="vLLM engine image carrying the MooncakeStore load_mask fix (images/vllm-mooncake).",
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, description="GPUs per replica (--tensor-parallel-size)."
    )
    block_size: int = Field(default=16, ge=1, description="KV block size in tokens (--block-size).")
    python_hash_seed: int = Field(
        default=0,
        ge=0,
        le=4294967295,
        description="PYTHONHASHSEED; identical on every replica so block hashes (store keys) agree.",
    )
    extra_args: list[str] = Field(default_factory=list, description="Extra `vllm serve` arguments, appended.")
    extra_env: list[EnvVar] = Field(default_factory=list, description="Extra environment variables.")
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description=(
            "Resources of the engine container. nvidia.com/gpu is set from tensorParallelSize; in embedded "
            "mode the store's memory is added to the memory request/limit."
        ),
    )
    shared_memory_size: Quantity | None = Field(
        default=None, description="Size limit of the memory-backed /dev/shm (unlimited when unset)."
    )
    port: int = Field(default=8000, ge=1, le=65535, description="HTTP port of the OpenAI-compatible server.")
    startup_timeout_seconds: int = Field(
        default=3600,
        ge=10,
        description="How long a replica may take to download and load its weights before it is restarted.",
    )
    gpus_per_node: int = Field(
        default=DEFAULT_GPUS_PER_NODE,
        ge=1,
        le=64,
        description=(
            "GPUs the largest node offers. A replica runs on one node: tensorParallelSize times a "
            "--pipeline-parallel-size in extraArgs must fit."
        ),
    )
    security_context: ContainerSecurityContext | None = Field(
        default=None,
        description=(
            "The engine container's securityContext; each field set here replaces the operator's default "
            "(allowPrivilegeEscalation: false, capabilities.drop [ALL]). store.rdma adds what RDMA needs."
        ),
    )

    def pipeline_parallel_size(self) -> int:
        """The --pipeline-parallel-size (-pp) in extraArgs (argparse keeps the last), 1 without one."""
        return _pipeline_parallel_size(self.extra_args)

    def gpus_per_replica(self) -> int:
        """GPUs one replica uses: one per worker, tensor-parallel times pipeline-parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size()

    @model_validator(mode="after")
    def _parallelism_fits_a_node(self) -> EngineSpec:
        for arg in self.extra_args:
            flag = engine_flag(arg)
            if flag is not None and _is_data_parallel(flag):
                raise ValueError(
                    f"engine.extraArgs must not contain {arg.split('=', 1)[0]}: a replica is one "
                    "data-parallel rank; scale data parallelism with spec.replicas (each replica is proven "
                    "by the canary and counted in its GPU request)"
                )
        gpus = self.tensor_parallel_size * _pipeline_parallel_size(self.extra_args)
        if gpus > self.gpus_per_node:
            raise ValueError(
                f"engine.tensorParallelSize ({self.tensor_parallel_size}) times the pipeline-parallel size "
                f"in engine.extraArgs ({gpus // self.tensor_parallel_size}) is {gpus} GPUs, more than "
                f"engine.gpusPerNode ({self.gpus_per_node}): a replica runs on one node"
            )
        return self

    @model_validator(mode="after")
    def _no_managed_settings(self) -> EngineSpec:
        for arg in self.extra_args:
            managed = managed_flag_of(arg)
            if managed is not None:
                option, source = managed
                spelled = "" if engine_flag(arg) == option else f" (vLLM reads {arg!r} as {option})"
                raise ValueError(
                    f"engine.extraArgs must not contain {option}{spelled}: it is set from {source}"
                )
            secret = secret_flag_of(arg)
            if secret is not None:
                option, instead = secret
                raise ValueError(
                    f"engine.extraArgs must not contain {option}: a secret on the command line lands in the "
                    f"pod spec and the operator's last-good record; use {instead}"
                )
        for env in self.extra_env:
            if env.name in MANAGED_ENV:
                raise ValueError(
                    f"engine.extraEnv must not set {env.name}: it is set from {MANAGED_ENV[env.name]}"
                )
        for section in (self.resources.requests, self.resources.limits):
            if GPU_RESOURCE in section:
                raise ValueError(
                    f"engine.resources must not set {GPU_RESOURCE}: it is set from engine.tensorParallelSize"
                )
        return self


class SpeculativeSpec(ApiModel):
    method: Literal["eagle3"] = Field(default="eagle3", description="Speculative decoding method.")
    model: str | None = Field(default=None, min_length=1, description="Draft model id.")
    revision: str | None = Field(
        default=None, min_length=1, description="Hugging Face revision of the draft (a commit)."
    )
    num_speculative_tokens: int = Field(default=3, ge=1)
    draft_tensor_parallel_size: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _draft_pinned(self) -> SpeculativeSpec:
        missing = [name for name, value in (("model", self.model), ("revision", self.revision)) if not value]
        if missing:
            raise ValueError(
                f"speculative.method {self.method} needs a draft model pinned to a revision; missing: "
                + ", ".join(f"speculative.{name}" for name in missing)
            )
        return self


# --- master high availability --------------------------------------------------------------------------

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

    image: str = Field(default=DEFAULT_ETCD_IMAGE, min_length=1, description="etcd image (etcd on PATH).")
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
    image: str | None = Field(
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


_EXPECTATIONS: TypeAdapter[list[Expectation]] = TypeAdapter(list[Expectation])


class ExpectationSpec(BaseModel):
    """One content check, e.g. {kind: json_values_include, values: [us-west, 4, 16]}."""

    # The other fields depend on `kind`; CanarySpec validates the list with the canary's own types, so
    # render, crd and the operator refuse the same checks. The schema stays open (kinds may be added).

    model_config = ConfigDict(frozen=True, extra="allow", strict=True)

    kind: str = Field(min_length=1, description="The check, e.g. json_object_only, json_values_include.")


class ComparisonSpec(ApiModel):
    """How the warm answer is compared with the cold one (docs/canary.md: the rule and its sources)."""

    mode: Literal["exact", "logprobs"] = Field(
        default="logprobs",
        description=(
            "logprobs: identical tokens pass; at the first divergence both answers' logprobs decide a "
            "benign near tie (passes, reported) from corruption. exact: token for token, for replicas "
            "on batch-invariant kernels."
        ),
    )
    top_k: int = Field(
        default=DEFAULT_TOP_K, ge=1, le=MAX_TOP_K, description="top_logprobs asked for per token."
    )
    max_tie_gap_nats: float = Field(
        default=DEFAULT_MAX_TIE_GAP_NATS,
        ge=0,
        le=10,
        description="Largest logprob gap between the two tokens, on each side, of a benign divergence.",
    )
    max_drift_nats: float = Field(
        default=DEFAULT_MAX_DRIFT_NATS,
        ge=0,
        le=10,
        description="Largest cold-versus-warm logprob change of a shared token before the divergence.",
    )

    @field_validator("max_tie_gap_nats", "max_drift_nats")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


class SuiteRequestSpec(ApiModel):
    """One more request each canary pair runs after spec.canary.request."""

    name: str = Field(pattern=SUITE_NAME_PATTERN, description="Shown in the report (a DNS label).")
    request: dict[str, Any] = Field(description="Chat-completions request body.")
    expectations: list[ExpectationSpec] | None = Field(
        default=None, description="Checks its answers must pass; unset: judged warm against cold only."
    )

    @field_validator("request")
    @classmethod
    def _request_the_canary_can_send(cls, request: dict[str, Any]) -> dict[str, Any]:
        check_chat_request(request)
        return request

    @field_validator("expectations")
    @classmethod
    def _checks_the_canary_knows(
        cls, expectations: list[ExpectationSpec] | None
    ) -> list[ExpectationSpec] | None:
        if expectations is not None:
            try:
                _EXPECTATIONS.validate_python([item.model_dump() for item in expectations])
            except ValidationError as error:
                raise ValueError("; ".join(describe_validation_error(error))) from None
        return expectations


class CanarySpec(ApiModel):
    enabled: bool = True
    request: dict[str, Any] | None = Field(
        default=None,
        description=(
            "Chat-completions request body sent to writer and reader. Unset: the customer's request "
            "(mooncake_operator.canary.customer_request())."
        ),
    )
    expectations: list[ExpectationSpec] | None = Field(
        default=None,
        description=(
            "Checks every answer must pass, as in `mooncake-operator canary --expect`. Unset: the "
            "customer's (one JSON object with the latest values, nothing before it); []: content checks off."
        ),
    )
    pairs: Literal["ring", "first"] = Field(
        default="ring", description="ring: every replica proven as writer and reader; first: replica 0 -> 1."
    )
    require_external_hit: bool = Field(
        default=True,
        description="Without a rise of the reader's external-hit counter the run is Inconclusive.",
    )
    timeout_seconds: int = Field(
        default=300,
        ge=1,
        description="Timeout of one canary request; lowered to the operator's ceiling (600 s by default).",
    )
    interval_seconds: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Re-run the canary this often; unset: only when something changes (a rollout, a replaced "
            "replica pod, a master restart or failover, the rerun annotation) and to retry an "
            "Inconclusive run."
        ),
    )
    on_failure: Literal["Hold", "Rollback"] = Field(
        default="Hold",
        description=(
            "Hold: keep the pods, take them out of the client Service. "
            "Rollback: restore the last good revision."
        ),
    )
    max_chat_body_bytes: int | None = Field(
        default=None,
        ge=1024,
        le=MAX_BODY_BYTES_LIMIT,
        description="Cap on one chat answer's body, decoded; unset: 4 MiB. Over it the run is Inconclusive.",
    )
    max_metrics_body_bytes: int | None = Field(
        default=None,
        ge=1024,
        le=MAX_BODY_BYTES_LIMIT,
        description="Cap on one metrics page, decoded; unset: 16 MiB. Over it the run is Inconclusive.",
    )
    comparison: ComparisonSpec = Field(default_factory=lambda: ComparisonSpec())
    suite: list[SuiteRequestSpec] | None = Field(
        default=None,
        max_length=MAX_SUITE_REQUESTS,
        description=(
            "More requests each pair runs after `request`. Unset: the default block-boundary suite "
            "(prompts ending exactly on, one past and one short of a block boundary, and one of many "
            "blocks, padded with the replicas' own tokenizer); []: none."
        ),
    )

    # The canary's own rules, so every reader of the models (render, crd, the operator) refuses the same
    # resources. `enabled` is declared first, so it is in `info.data` here. A disabled canary is not read.
    @field_validator("request")
    @classmethod
    def _request_the_canary_can_send(
        cls, request: dict[str, Any] | None, info: ValidationInfo
    ) -> dict[str, Any] | None:
        if request is not None and info.data.get("enabled", True):
            check_chat_request(request)
        return request

    @field_validator("expectations")
    @classmethod
    def _checks_the_canary_knows(
        cls, expectations: list[ExpectationSpec] | None, info: ValidationInfo
    ) -> list[ExpectationSpec] | None:
        if expectations is not None and info.data.get("enabled", True):
            try:
                _EXPECTATIONS.validate_python([item.model_dump() for item in expectations])
            except ValidationError as error:
                raise ValueError("; ".join(describe_validation_error(error))) from None
        return expectations


RolloutStrategy = Literal["InPlace", "BlueGreen"]


class RolloutSpec(ApiModel):
    strategy: RolloutStrategy = Field(
        default="InPlace",
        description=(
            "How a change of the replica pod template reaches users. InPlace (default): the replica "
            "StatefulSet rolls one pod after another and a new pod joins the client Service only once a "
            "canary proved it; it needs no GPUs beyond spec.replicas, which is why it is the default. "
            "BlueGreen: a second replica set of the new revision comes up beside the serving one, the "
            "canary proves it alone, and only then the client Service switches to it and the old set is "
            "removed (a failed canary never switches: onFailure Hold keeps the new set for inspection, "
            "Rollback removes it). It costs twice the replicas' GPUs during a rollout."
        ),
    )


class MooncakeServingSpec(ApiModel):
    model: ModelSpec
    engine: EngineSpec
    speculative: SpeculativeSpec | None = Field(default=None, description="Speculative decoding (Eagle-3).")
    replicas: int = Field(
        default=2, ge=1, le=MAX_REPLICAS, description="Number of vLLM replicas sharing the store."
    )
    store: StoreSpec
    canary: CanarySpec = Field(default_factory=CanarySpec)
    scheduling: ReplicaScheduling | None = Field(default=None, description="Where replica pods run.")
    image_pull_secrets: list[LocalObjectReference] | None = Field(
        default=None, description="Secrets for pulling the engine and master images."
    )
    pod_metadata: PodMetadata | None = Field(
        default=None, description="Extra labels and annotations of replica and master pods."
    )
    network_policy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec, description="NetworkPolicies of master and replicas."
    )
    # Optional, so resources written before it existed keep their spec digest (revision) unchanged.
    pod: ReplicaPodSpec = Field(
        default_factory=ReplicaPodSpec,
        description="Replica pods: securityContext, ServiceAccount, drain budget, extra volumes, containers.",
    )
    rollout: RolloutSpec | None = Field(
        default=None, description="Rollout strategy of the replicas; unset: strategy InPlace."
    )

    @property
    def rollout_strategy(self) -> RolloutStrategy:
        return self.rollout.strategy if self.rollout is not None else "InPlace"

    @model_validator(mode="after")
    def _host_network_one_per_node(self) -> MooncakeServingSpec:
        rdma = self.store.rdma
        scheduling = self.scheduling
        if (
            rdma is not None
            and rdma.host_network
            and scheduling is not None
            and scheduling.replica_anti_affinity in ("Preferred", "None")
        ):
            raise ValueError(
                "scheduling.replicaAntiAffinity must be Required (or unset) with store.rdma.hostNetwork: "
                "two replicas on one node would bind the same host ports"
            )
        return self

    @model_validator(mode="after")
    def _pod_additions_fit_the_engine(self) -> MooncakeServingSpec:
        for container in self.pod.sidecars:
            for port in container.get("ports") or []:
                if isinstance(port, Mapping) and port.get("containerPort") == self.engine.port:
                    raise ValueError(
                        f"pod.sidecars {container['name']}: port {self.engine.port} is engine.port (the "
                        "containers of a pod share its network)"
                    )
        rdma = self.store.rdma
        context = self.engine.security_context
        host_devices = rdma is not None and rdma.host_devices
        if host_devices and context is not None and context.allow_privilege_escalation is False:
            raise ValueError(
                "engine.securityContext.allowPrivilegeEscalation: false contradicts "
                "store.rdma.hostDevices, which runs the engine privileged; use store.rdma.resourceName"
            )
        return self

    @model_validator(mode="after")
    def _canary_needs_pairs(self) -> MooncakeServingSpec:
        if self.canary.enabled and self.replicas < 2:
            raise ValueError(
                f"replicas is {self.replicas} but the canary needs at least 2 replicas (a writer and a "
                "reader); set replicas >= 2 or canary.enabled: false"
            )
        return self


# --- status --------------------------------------------------------------------------------------------

# The canary's Verdict, read back from the API as the string it was written as.
VerdictField = Annotated[Verdict, Strict(False)]

Phase = Literal["Pending", "Deploying", "Canary", "Ready", "CanaryFailed", "Degraded", "Invalid"]
ConditionType = Literal["MasterReady", "ReplicasReady", "CanaryPassed", "Ready", "Reconciling", "Stalled"]
# What each reconcile decides; then kstatus' two, derived from Ready (conditions.kstatus_states).
CONDITION_TYPES: tuple[ConditionType, ...] = ("MasterReady", "ReplicasReady", "CanaryPassed", "Ready")
KSTATUS_CONDITION_TYPES: tuple[ConditionType, ...] = ("Reconciling", "Stalled")


class Condition(ApiModel):
    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = ""
    last_transition_time: str = Field(description="RFC 3339 time of the last status change.")
    observed_generation: int | None = Field(default=None, ge=0)


class ReplicaCounts(ApiModel):
    desired: int = Field(ge=0)
    ready: int = Field(ge=0)


class DivergenceEvidence(ApiModel):
    """The first token where the warm answer left the cold one, and the margins that judged it."""

    position: int = Field(ge=0, description="Index of the first differing token.")
    kind: Literal["benign", "corruption", "unjudged"]
    cold_token: str | None = None
    warm_token: str | None = None
    cold_gap_nats: float | None = Field(
        default=None, description="In the cold distribution: |logprob(cold token) - logprob(warm token)|."
    )
    warm_gap_nats: float | None = Field(
        default=None, description="In the warm distribution: |logprob(warm token) - logprob(cold token)|."
    )
    max_drift_nats: float | None = Field(
        default=None, description="Largest cold-versus-warm change of a shared token's logprob before it."
    )
    shared_tokens: int = Field(default=0, ge=0)
    reasons: list[str] = Field(default_factory=list, description="Why it is not benign.")


class PairEvidence(ApiModel):
    writer: str
    reader: str
    verdict: VerdictField
    reason: str = ""
    cache_salt: str | None = None
    prompt_tokens: int | None = Field(default=None, ge=0)
    external_hit_tokens: int | None = Field(default=None, ge=0, description="Rise of the reader's counter.")
    expected_external_hit_tokens: int | None = Field(default=None, ge=0)
    load_get_keys: int | None = Field(default=None, ge=0, description="Store keys the reader loaded.")
    answers_equal: bool | None = None
    cold_latency_ms: float | None = Field(default=None, ge=0)
    warm_latency_ms: float | None = Field(default=None, ge=0)
    first_mismatch: Mismatch | None = None
    request: str | None = Field(default=None, description="Which of the run's requests the pair ran.")
    divergence: DivergenceEvidence | None = Field(
        default=None, description="The first differing token, judged: benign (passed) or not."
    )
    violations: list[str] = Field(default_factory=list, description="Expectations violated, one per entry.")
    notes: list[str] = Field(default_factory=list, description="Evidence that did not decide the verdict.")


class CanaryTarget(ApiModel):
    """What a canary run was run against; a difference from the present state makes the next run due."""

    revision: str = Field(
        description="Spec revision: the digest of the spec the replicas were rendered from."
    )
    generation: int | None = Field(default=None, ge=0)
    replica_pods: list[str] = Field(
        default_factory=list,
        description="name=uid of each replica pod, then #N once its containers restarted N times.",
    )
    master_pod: str | None = Field(default=None, description="UID of the master pod.")
    master_restarts: int = Field(default=0, ge=0, description="Container restarts of the master pod.")
    rerun: str | None = Field(default=None, description="Value of the rerun-canary annotation.")
    master_leader: str | None = Field(
        default=None, description="Highly available masters: the pod that led (Mooncake's own view)."
    )


class CanaryStatus(ApiModel):
    run_id: str
    verdict: VerdictField
    reason: str = ""
    external_hit_tokens: int | None = Field(default=None, ge=0, description="Sum over pairs.")
    started_at: str | None = None
    finished_at: str | None = None
    pairs: list[PairEvidence] = Field(default_factory=list)
    target: CanaryTarget | None = None


class PodTraffic(ApiModel):
    """One replica pod's place in user traffic, and why."""

    name: str
    uid: str
    revision: str | None = Field(
        default=None,
        description="Pod template hash: the pod's controller-revision-hash, the pod template it runs.",
    )
    serving: bool = Field(description="Whether the client Service routes users to it (label traffic=on).")
    reason: str = ""
    proven_by: str | None = Field(
        default=None, description="Run id of the canary that proved this pod at its pod template."
    )
    restarts: int | None = Field(
        default=None,
        ge=0,
        description="The pod's container restart count when this entry was written: a higher count (the "
        "engine restarted in place) takes the pod out of traffic until a canary proves the new process.",
    )


class TrafficStatus(ApiModel):
    serving: int = Field(default=0, ge=0, description="Replica pods in the client Service.")
    pods: list[PodTraffic] = Field(default_factory=list)


CandidatePhase = Literal["Deploying", "Canary", "Inconclusive", "Held"]


class RolloutStatus(ApiModel):
    """Which replica set serves users and, during a BlueGreen rollout, the candidate set and its phase."""

    strategy: RolloutStrategy
    serving_set: str | None = Field(
        default=None, description="The replica StatefulSet whose proven pods serve users."
    )
    candidate_set: str | None = Field(
        default=None, description="BlueGreen: the new revision's StatefulSet, not serving until it passes."
    )
    candidate_phase: CandidatePhase | None = Field(
        default=None,
        description=(
            "Deploying, Canary (being proven), Inconclusive (retried; never switched to), Held (failed, "
            "kept for inspection by onFailure Hold; never switched to)."
        ),
    )
    message: str = ""


class HighAvailabilityStatus(ApiModel):
    """Which master leads, as the masters themselves report it (/health), and how often it changed."""

    leader: str | None = Field(default=None, description="Pod of the leading master; unset while none leads.")
    leader_address: str | None = Field(default=None, description="The address the leader publishes.")
    view_version: int | None = Field(default=None, ge=0, description="Mooncake's master-view version.")
    failovers: int = Field(default=0, ge=0, description="Leader changes the operator observed.")
    last_failover_time: str | None = Field(default=None, description="RFC 3339 time of the last one.")


class MooncakeServingStatus(ApiModel):
    phase: Phase | None = None
    observed_generation: int | None = Field(default=None, ge=0)
    conditions: list[Condition] = Field(default_factory=list)
    replicas: ReplicaCounts | None = None
    selector: str | None = Field(
        default=None,
        description="The replica pods' label selector, for the scale subresource (HPA, KEDA).",
    )
    canary: CanaryStatus | None = None
    last_good_revision: str | None = Field(
        default=None, description="Spec revision the last passing canary proved (what Rollback restores)."
    )
    desired_revision: str | None = Field(default=None, description="Spec revision: the digest of the spec.")
    serving_revision: str | None = Field(
        default=None, description="Spec revision the children are rendered from."
    )
    failed_revision: str | None = Field(
        default=None, description="Spec revision rolled back after a failure."
    )
    out_of_traffic: list[str] = Field(
        default_factory=list, description="Replica pods held out of the client Service by a failed canary."
    )
    traffic: TrafficStatus | None = Field(
        default=None, description="Which replica pods serve users, and why (off until a canary proves them)."
    )
    high_availability: HighAvailabilityStatus | None = Field(
        default=None, description="The masters' leader (store.master.highAvailability only)."
    )
    rollout: RolloutStatus | None = Field(
        default=None, description="The serving replica set and, with BlueGreen, the candidate set."
    )
    foreign_pods: list[str] | None = Field(
        default=None,
        max_length=MAX_FOREIGN_PODS,
        description=(
            "Pods the client Service selects (they carry every label of its selector) that no replica "
            "StatefulSet of this resource created: they get user traffic no canary proved. Unset when "
            f"none; at most {MAX_FOREIGN_PODS} named."
        ),
    )


# --- resource ------------------------------------------------------------------------------------------


class ObjectMeta(BaseModel):
    """The parts of metadata the operator reads; everything the API server adds is ignored."""

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True, alias_generator=to_camel)

    name: str = Field(
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$",
        description="Lower-case letters, digits and '-', starting with a letter (children are Services).",
    )
    namespace: str = "default"
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class MooncakeServing(ApiModel):
    api_version: Literal["serving.mooncake-operator.dev/v1alpha1"] = "serving.mooncake-operator.dev/v1alpha1"
    kind: Literal["MooncakeServing"] = "MooncakeServing"
    metadata: ObjectMeta
    spec: MooncakeServingSpec
    status: MooncakeServingStatus | None = None

    @model_validator(mode="after")
    def _networks_in_own_namespace(self) -> MooncakeServing:
        rdma = self.spec.store.rdma
        if rdma is None or rdma.networks is None:
            return self
        for namespace in multus_network_namespaces(rdma.networks):
            if namespace != self.metadata.namespace:
                raise ValueError(
                    f"spec.store.rdma.networks: the network attachment in namespace {namespace!r} is not "
                    f"in this resource's namespace {self.metadata.namespace!r}: name attachments of this "
                    "namespace only (another tenant's networks are not this resource's to join)"
                )
        return self

    @model_validator(mode="after")
    def _host_network_not_co_located(self) -> MooncakeServing:
        rdma = self.spec.store.rdma
        scheduling = self.spec.scheduling
        if rdma is None or not rdma.host_network or scheduling is None or scheduling.affinity is None:
            return self
        pod_affinity = scheduling.affinity.pod_affinity
        own = replica_pod_labels(self.metadata.name)
        for term in (
            (pod_affinity.required_during_scheduling_ignored_during_execution or []) if pod_affinity else []
        ):
            selects_own = term.label_selector is not None and term.label_selector.matches(own)
            if term.topology_key == HOSTNAME_TOPOLOGY_KEY and selects_own and not term.namespaces:
                raise ValueError(
                    "spec.scheduling.affinity.podAffinity requires replicas on one node "
                    f"({HOSTNAME_TOPOLOGY_KEY}), but spec.store.rdma.hostNetwork allows one replica per node"
                )
        return self


def replica_pod_labels(name: str) -> dict[str, str]:
    """The operator's labels on the replica pods of resource `name` (render.labels builds the same)."""
    return {
        "app.kubernetes.io/name": "vllm",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/part-of": "mooncake-serving",
        "app.kubernetes.io/managed-by": "mooncake-operator",
    }


class InvalidResourceError(ValueError):
    """A MooncakeServing that can never be valid; `problems` lists every reason, one per entry."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid MooncakeServing:\n" + "\n".join(f"  - {p}" for p in problems))


def describe_validation_error(error: ValidationError) -> list[str]:
    """One readable line per problem: the wire path (camelCase) and the message."""
    problems = []
    for item in error.errors():
        path = ".".join(map(str, item["loc"]))
        message = str(item["msg"]).removeprefix("Value error, ")
        problems.append(f"{path}: {message}" if path else message)
    return problems


def plain(obj: Any) -> Any:
    """Mappings and sequences (e.g. read-only views) as plain dicts and lists, which the strict models
    require."""
    if isinstance(obj, Mapping):
        return {key: plain(value) for key, value in obj.items()}
    if isinstance(obj, Sequence) and not isinstance(obj, str | bytes):
        return [plain(value) for value in obj]
    return obj


def parse_resource(obj: Any) -> MooncakeServing:
    """Validate a whole MooncakeServing (as read from YAML or the API); raises InvalidResourceError."""
    try:
        return MooncakeServing.model_validate(plain(obj))
    except ValidationError as error:
        raise InvalidResourceError(describe_validation_error(error)) from error
