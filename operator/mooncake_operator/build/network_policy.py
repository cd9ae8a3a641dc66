"""NetworkPolicies of the master, the replicas and a managed etcd: who may reach which port, and
where the replicas may connect when egress is restricted.
"""

from __future__ import annotations

from typing import Any

from mooncake_operator.api.kube_types import NetworkPolicyPeer
from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.build.etcd import ETCD_CLIENT_PORT, ETCD_PEER_PORT, ha_enabled
from mooncake_operator.build.names import (
    COMPONENT_ETCD,
    COMPONENT_MASTER,
    COMPONENT_REPLICA,
    LABEL_NAME,
    ChildNames,
    HaNames,
    Manifest,
    labels,
    object_meta,
    selector,
)
from mooncake_operator.build.replicas import ReplicaTemplate

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
    quotas, drains), so nobody but the operator is admitted to it (see docs/api.md). A managed etcd gets
    a third: its client port from this resource's masters and replicas, its peer port from its own
    members. The replicas' egress is restricted when
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
