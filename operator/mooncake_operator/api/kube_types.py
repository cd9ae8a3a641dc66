"""Kubernetes' own shapes, hand-typed (field names, enums, nesting) so the generated CRD validates
them and the builders pass them through unchanged (`to_wire()` leaves unset fields out): label
selectors, tolerations, affinity, security contexts, volume mounts, environment, resources, network
policy peers. Affinity is deep but not recursive, so it is typed all the way down: the CRD stays
structural and the API server checks it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Literal

from pydantic import Field, model_validator

from mooncake_operator.api.base import ApiModel
from mooncake_operator.api.quantities import Quantity

GPU_RESOURCE = "nvidia.com/gpu"
MULTUS_NETWORKS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"
HOSTNAME_TOPOLOGY_KEY = "kubernetes.io/hostname"

# Kubernetes' qualified-name grammar (label and annotation keys) and label-value grammar.
_NAME_PART = r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]"
_DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_QUALIFIED_NAME_RE = re.compile(rf"^({_DNS_SUBDOMAIN}/)?{_NAME_PART}$")
LABEL_VALUE_RE = re.compile(rf"^({_NAME_PART})?$")


def check_metadata_key(key: str, field: str) -> None:
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


class LocalObjectReference(ApiModel):
    name: str = Field(min_length=1)


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
