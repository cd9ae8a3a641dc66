"""Issue 21, Medium 11: the replicas' HTTP port closed to unlisted pods where the operator's administrator
chooses deny-by-default (--replica-ingress-default=listed-clients), and an egress policy for the replicas
(DNS, the store, its masters and managed etcd, and what the resource lists)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import yaml
from tests.support.fake_api import runtime_answering

from mooncake_operator.api.examples import reference_deployment_yaml
from mooncake_operator.api.resource import parse_resource
from mooncake_operator.build.etcd import ETCD_CLIENT_PORT
from mooncake_operator.build.names import COMPONENT_ETCD
from mooncake_operator.build.network_policy import DEFAULT_DNS_PEER, network_policies, operator_peer
from mooncake_operator.reconcile.act.core import reconcile
from mooncake_operator.runtime.settings import OperatorSettings, SettingsError

pytestmark = pytest.mark.unit

OPERATOR = operator_peer("mooncake-system")


def resource(network_policy: dict[str, Any] | None = None, ha: bool = False) -> Any:
    obj = yaml.safe_load(reference_deployment_yaml())
    if network_policy is not None:
        obj["spec"]["networkPolicy"] = network_policy
    if ha:
        obj["spec"]["store"]["master"]["highAvailability"] = {"enabled": True}
    return parse_resource(obj)


def replica_policy(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    (policy,) = [
        m for m in manifests if m["kind"] == "NetworkPolicy" and m["metadata"]["name"].endswith("-replica")
    ]
    return policy


def http_rule(policy: dict[str, Any]) -> dict[str, Any]:
    rule: dict[str, Any] = policy["spec"]["ingress"][1]
    return rule


def test_unlisted_clients_are_denied_where_the_operator_says_so() -> None:
    serving = resource()
    closed = replica_policy(network_policies(serving, owner_uid=None, open_http_by_default=False))
    assert http_rule(closed)["from"] == [OPERATOR]
    # The default keeps existing client Services working: no "from", anyone.
    assert "from" not in http_rule(replica_policy(network_policies(serving, owner_uid=None)))
    # Listed clients are the switch, whatever the default.
    listed = resource({"clients": [{"podSelector": {"matchLabels": {"role": "gateway"}}}]})
    for default in (True, False):
        rule = http_rule(
            replica_policy(network_policies(listed, owner_uid=None, open_http_by_default=default))
        )
        assert rule["from"] == [OPERATOR, {"podSelector": {"matchLabels": {"role": "gateway"}}}]


def test_the_ingress_default_is_a_checked_setting() -> None:
    assert OperatorSettings().open_http_by_default
    assert not OperatorSettings(replica_ingress_default="listed-clients").open_http_by_default
    with pytest.raises(SettingsError, match="replica-ingress-default must be one of anyone, listed-clients"):
        OperatorSettings(replica_ingress_default="nobody")


async def test_the_operator_applies_the_deny_by_default_policy() -> None:
    body = resource().to_wire()
    body["metadata"] = {"name": "demo", "namespace": "ns", "uid": "u-1", "generation": 1}
    applied: dict[str, Any] = {}

    def answer(request: httpx.Request) -> httpx.Response:
        if request.method == "PATCH" and "/networkpolicies/" in request.url.path:
            sent = json.loads(request.content)
            applied[sent["metadata"]["name"]] = sent
            return httpx.Response(200, json=sent)
        return httpx.Response(200, json=body)

    runtime = runtime_answering(
        answer, operator_namespace="mooncake-system", replica_ingress_default="listed-clients"
    )
    try:
        await reconcile(runtime, "ns", "demo")
    finally:
        await runtime.close()
    assert http_rule(applied["demo-replica"])["from"] == [OPERATOR]


def test_egress_is_unrestricted_unless_asked() -> None:
    policy = replica_policy(network_policies(resource(), owner_uid=None))
    assert policy["spec"]["policyTypes"] == ["Ingress"] and "egress" not in policy["spec"]


def test_restricted_egress_allows_dns_the_store_and_the_listed_destinations() -> None:
    hub = {"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"port": 443}]}
    serving = resource({"egress": {"to": [hub]}})
    spec = replica_policy(network_policies(serving, owner_uid=None))["spec"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    own = {"app.kubernetes.io/instance": "minimax-m25", "app.kubernetes.io/component": "engine"}
    masters = {"app.kubernetes.io/instance": "minimax-m25", "app.kubernetes.io/component": "store-master"}
    dns, peers, master, listed = spec["egress"]
    assert dns == {
        "to": [DEFAULT_DNS_PEER],
        "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
    }
    assert peers == {"to": [{"podSelector": {"matchLabels": own}}]}
    assert master == {
        "to": [{"podSelector": {"matchLabels": masters}}],
        "ports": [{"protocol": "TCP", "port": serving.spec.store.master.rpc_port}],
    }
    assert listed == {
        "to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}],
        "ports": [{"protocol": "TCP", "port": 443}],
    }


def test_restricted_egress_reaches_a_managed_etcd_and_a_chosen_dns() -> None:
    dns = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "dns"}}}]
    spec = replica_policy(network_policies(resource({"egress": {"dns": dns}}, ha=True), owner_uid=None))[
        "spec"
    ]
    assert spec["egress"][0]["to"] == dns
    etcd = spec["egress"][3]
    assert etcd["ports"] == [{"protocol": "TCP", "port": ETCD_CLIENT_PORT}]
    assert etcd["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == COMPONENT_ETCD
    assert len(spec["egress"]) == 4
