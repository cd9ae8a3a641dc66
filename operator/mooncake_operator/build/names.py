"""Names, labels and selectors of a resource's children, shared by the builders, the planner, the
observer and the watch cache, so every reader agrees with what was written.

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

With highly available masters, NAME-masters (headless) and NAME-master (a StatefulSet) replace the
master's Service and Deployment, and an operator-run etcd is NAME-etcd (StatefulSet and headless
Service).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mooncake_operator import __version__
from mooncake_operator.api.group import GROUP
from mooncake_operator.api.resource import MooncakeServing

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
TRAFFIC_LABEL = f"{GROUP}/traffic"
TRAFFIC_ON = "on"
TRAFFIC_OFF = "off"
# Hash of the store config on the pod template: a config change rolls the replicas.
CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"
# On a replica StatefulSet: the digest of the pod template it was applied with (BlueGreen compares it).
TEMPLATE_ANNOTATION = f"{GROUP}/template"
# On a BlueGreen candidate set's pods and selector: which set they belong to (sets share the instance's
# labels, and a StatefulSet selector is immutable, so the first set keeps the plain selector).
REPLICA_SET_LABEL = f"{GROUP}/replica-set"

COMPONENT_MASTER = "store-master"
COMPONENT_STORE_CONFIG = "store-config"
COMPONENT_REPLICA = "engine"
COMPONENT_ETCD = "store-etcd"
ENGINE_CONTAINER = "vllm"
MASTER_CONTAINER = "mooncake-master"
HTTP_PORT_NAME = "http"
RPC_PORT_NAME = "rpc"
METRICS_PORT_NAME = "metrics"
HEALTH_PATH = "/health"


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


@dataclass(frozen=True)
class HaNames:
    masters_headless: str  # headless Service of the master StatefulSet
    etcd: str  # StatefulSet and its headless Service

    @classmethod
    def of(cls, name: str) -> HaNames:
        return cls(masters_headless=f"{name}-masters", etcd=f"{name}-etcd")


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
