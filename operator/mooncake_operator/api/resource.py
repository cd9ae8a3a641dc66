"""A whole MooncakeServing: metadata, spec and status, parsed and validated in one step
(`parse_resource`); a resource that can never be valid raises InvalidResourceError with every
problem.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from mooncake_operator.api.base import ApiModel, describe_validation_error
from mooncake_operator.api.group import replica_pod_labels
from mooncake_operator.api.kube_types import HOSTNAME_TOPOLOGY_KEY, multus_network_namespaces
from mooncake_operator.api.spec import MooncakeServingSpec
from mooncake_operator.api.status import MooncakeServingStatus

# Children are named "<name>-store-config", "<name>-replica-<ordinal>" ...; a StatefulSet's pods carry a
# "controller-revision-hash" label of "<statefulset>-<10 chars>", which must fit in 63 characters.
MAX_NAME_LENGTH = 40


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


class InvalidResourceError(ValueError):
    """A MooncakeServing that can never be valid; `problems` lists every reason, one per entry."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid MooncakeServing:\n" + "\n".join(f"  - {p}" for p in problems))


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
        raise InvalidResourceError(describe_validation_error(error, MooncakeServing)) from error
