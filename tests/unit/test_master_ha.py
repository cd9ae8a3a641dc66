"""Highly available masters: the API rules, the argv/config both renderer and sandbox use, the children,
the leader as the operator reads it from the masters, failover counting and the canary's trigger."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.support.manifests import with_change

from mooncake_operator.api.examples import reference_deployment, reference_deployment_yaml
from mooncake_operator.api.resource import InvalidResourceError, MooncakeServing, parse_resource
from mooncake_operator.api.status import CanaryStatus, HighAvailabilityStatus, MooncakeServingStatus
from mooncake_operator.build.engine_args import HaTopology, master_argv, replica_launch
from mooncake_operator.build.etcd import etcd_stateful_set, ha_topology
from mooncake_operator.build.manifests import render_all
from mooncake_operator.build.master import master_stateful_set, retired_workloads
from mooncake_operator.build.names import master_pod_urls, replica_pod_names
from mooncake_operator.build.network_policy import network_policies
from mooncake_operator.build.replicas import replica_stateful_set
from mooncake_operator.build.store_config import store_config_json
from mooncake_operator.cli.main import build_parser
from mooncake_operator.cli.run import settings_from
from mooncake_operator.reconcile.decide import choose, leadership, plan, schedule
from mooncake_operator.reconcile.decide.actions import PostEvent
from mooncake_operator.reconcile.decide.canary_run import CanaryRun
from mooncake_operator.reconcile.decide.leadership import MasterView
from mooncake_operator.reconcile.decide.observe import MasterState, Observation, PodInfo, ReplicaState
from mooncake_sandbox import SandboxOptions
from mooncake_sandbox import command as sandbox_command
from mooncake_sandbox.ha import sandbox_ha_resource
from mooncake_sandbox.runtime import MASTER_CLIENT_TTL_S, MASTER_KV_LEASE_TTL_S, sandbox_spec

pytestmark = pytest.mark.unit

HA = "spec.store.master.highAvailability"
# /health of mooncake_master 0.3.13.post1 with -enable_ha, as measured (leader, then a standby).
LEADER_HEALTH = {
    "status": "ok",
    "role": "leader",
    "ha_state": "serving",
    "service_ready": True,
    "leader_address": "10.0.0.5:50051",
    "view_version": 9,
}
STANDBY_HEALTH = {**LEADER_HEALTH, "role": "standby", "ha_state": "standby", "service_ready": False}


def resource_with(ha: dict[str, Any] | None) -> MooncakeServing:
    obj = yaml.safe_load(reference_deployment_yaml())
    return parse_resource(with_change(obj, HA, ha))


def problems(ha: dict[str, Any]) -> list[str]:
    with pytest.raises(InvalidResourceError) as caught:
        resource_with(ha)
    return caught.value.problems


# --- API ---------------------------------------------------------------------------------------------


def test_off_by_default_and_defaults_when_on() -> None:
    assert not reference_deployment().spec.store.master.high_availability.enabled
    ha = resource_with({"enabled": True}).spec.store.master.high_availability
    assert (ha.replicas, ha.enable_oplog) == (3, True)
    managed = ha.etcd.managed_or_default()
    assert managed is not None and managed.replicas == 1 and managed.storage_size == "1Gi"


@pytest.mark.parametrize(
    ("ha", "message"),
    [
        (
            {"enabled": True, "etcd": {"managed": {}, "external": {"endpoints": ["e:2379"]}}},
            "set either external (your etcd) or managed",
        ),
        ({"enabled": True, "etcd": {"managed": {"replicas": 2}}}, "must be odd"),
        ({"enabled": True, "etcd": {"external": {"endpoints": ["https://e:2379"]}}}, "without a scheme"),
        ({"enabled": True, "etcd": {"external": {"endpoints": ["e:99999"]}}}, "host:port"),
        ({"enabled": True, "etcd": {"external": {"endpoints": []}}}, "at least 1"),
        ({"enabled": True, "replicas": 1}, "greater than or equal to 2"),
    ],
)
def test_invalid_settings_are_rejected_with_the_field(ha: dict[str, Any], message: str) -> None:
    found = problems(ha)
    assert any(message in problem and problem.startswith(HA) for problem in found), found


def test_the_cluster_id_env_is_managed() -> None:
    obj = yaml.safe_load(reference_deployment_yaml())
    obj = with_change(obj, "spec.engine.extraEnv", [{"name": "MC_STORE_CLUSTER_ID", "value": "x"}])
    with pytest.raises(InvalidResourceError, match="MC_STORE_CLUSTER_ID"):
        parse_resource(obj)


# --- engine_args: one source for renderer and sandbox --------------------------------------------------


def test_topology_gives_the_client_address_and_the_master_flags() -> None:
    plain = HaTopology(etcd_endpoints=("a:2379", "b:2379"), cluster_id="c")
    assert plain.master_server_address == "etcd://a:2379;b:2379"
    assert plain.client_env() == {"MC_STORE_CLUSTER_ID": "c"}
    tls = HaTopology(etcd_endpoints=("a:2379",), cluster_id="c", tls=True, enable_oplog=False)
    assert tls.master_server_address == "etcd://https://a:2379"
    assert tls.client_env()["SSL_CERT_DIR"] == "/etc/ssl/certs:/etc/mooncake/etcd-ca"
    argv = master_argv(reference_deployment().spec, rpc_address="10.0.0.5", ha=tls)
    assert argv[-5:] == (
        "-enable_ha=true",
        "-ha_backend_type=etcd",
        "-etcd_endpoints=https://a:2379",
        "-cluster_id=c",
        "-enable_oplog=false",
    )
    assert "-rpc_address=10.0.0.5" in argv


def test_replica_launch_refuses_an_address_that_bypasses_the_election() -> None:
    topology = HaTopology(etcd_endpoints=("a:2379",), cluster_id="c")
    with pytest.raises(ValueError, match="etcd://a:2379"):
        replica_launch(reference_deployment().spec, master_address="master:50051", ha=topology)
    launch = replica_launch(reference_deployment().spec, master_address="etcd://a:2379", ha=topology)
    assert launch.env["MC_STORE_CLUSTER_ID"] == "c"
    assert launch.store_config["master_server_address"] == "etcd://a:2379"


def test_the_sandbox_derives_its_topology_through_the_renderer() -> None:
    resource = sandbox_ha_resource("127.0.0.1:23790", masters=3, enable_oplog=True)
    topology = ha_topology(resource)
    assert topology == HaTopology(
        etcd_endpoints=("127.0.0.1:23790",), cluster_id="mooncake-operator.default.minimax-m25"
    )


def test_the_sandbox_ha_masters_get_its_master_ttls() -> None:
    """`--master-ha` masters run with the sandbox's client and lease TTLs, as its single master does."""
    master = sandbox_spec(speculative=True).store.master
    resource = sandbox_ha_resource("127.0.0.1:23790", masters=3, enable_oplog=False, master=master)
    argv = master_argv(resource.spec, ha=ha_topology(resource))
    assert f"-client_ttl={MASTER_CLIENT_TTL_S}" in argv
    assert f"-default_kv_lease_ttl={MASTER_KV_LEASE_TTL_S}s" in argv
    assert "-enable_ha=true" in argv


# --- children ------------------------------------------------------------------------------------------


def kinds(resource: MooncakeServing) -> list[str]:
    return [f"{m['kind']}/{m['metadata']['name']}" for m in render_all(resource, owner_uid="u")]


def test_managed_etcd_children_and_client_config() -> None:
    resource = resource_with(
        {"enabled": True, "etcd": {"managed": {"replicas": 3, "storageClassName": "fast"}}}
    )
    assert kinds(resource) == [
        "NetworkPolicy/minimax-m25-master",
        "NetworkPolicy/minimax-m25-replica",
        "NetworkPolicy/minimax-m25-etcd",
        "ConfigMap/minimax-m25-store-config",
        "Service/minimax-m25-etcd",
        "StatefulSet/minimax-m25-etcd",
        "Service/minimax-m25-masters",
        "StatefulSet/minimax-m25-master",
        "Service/minimax-m25-replicas",
        "StatefulSet/minimax-m25-replica",
        "Service/minimax-m25",
        "PodDisruptionBudget/minimax-m25-replica",
    ]
    config = yaml.safe_load(store_config_json(resource))
    endpoints = [f"minimax-m25-etcd-{i}.minimax-m25-etcd.default.svc:2379" for i in range(3)]
    assert config["master_server_address"] == "etcd://" + ";".join(endpoints)
    etcd = etcd_stateful_set(resource, owner_uid=None)
    command = etcd["spec"]["template"]["spec"]["containers"][0]["command"]
    assert any(
        arg.startswith("--initial-cluster=minimax-m25-etcd-0=http://") and arg.count("=http") == 3
        for arg in command
    )
    claim = etcd["spec"]["volumeClaimTemplates"][0]["spec"]
    assert claim == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "1Gi"}},
        "storageClassName": "fast",
    }
    replica = replica_stateful_set(resource, owner_uid=None)["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "MC_STORE_CLUSTER_ID", "value": "mooncake-operator.default.minimax-m25"} in replica["env"]


def test_masters_publish_their_pod_ip_and_are_ready_as_standbys() -> None:
    resource = resource_with({"enabled": True})
    master = master_stateful_set(resource, owner_uid=None)
    container = master["spec"]["template"]["spec"]["containers"][0]
    assert "-rpc_address=$(POD_IP)" in container["command"]
    assert container["env"][0] == {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert master["spec"]["replicas"] == 3
    assert master_pod_urls(resource) == [
        f"http://minimax-m25-master-{i}.minimax-m25-masters.default.svc:9003" for i in range(3)
    ]


def test_external_tls_etcd_mounts_the_ca_for_masters_and_replicas() -> None:
    resource = resource_with(
        {
            "enabled": True,
            "etcd": {"external": {"endpoints": ["e:2379"], "tls": {"caSecretRef": {"name": "ca"}}}},
        }
    )
    assert "StatefulSet/minimax-m25-etcd" not in kinds(resource)
    for workload in (
        master_stateful_set(resource, owner_uid=None),
        replica_stateful_set(resource, owner_uid=None),
    ):
        pod = workload["spec"]["template"]["spec"]
        assert {
            "name": "etcd-ca",
            "secret": {"secretName": "ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]},
        } in pod["volumes"]
        env = {item["name"]: item.get("value") for item in pod["containers"][0]["env"]}
        assert env["SSL_CERT_DIR"] == "/etc/ssl/certs:/etc/mooncake/etcd-ca"
    assert yaml.safe_load(store_config_json(resource))["master_server_address"] == "etcd://https://e:2379"


def test_switching_modes_retires_the_other_modes_workloads() -> None:
    single = [(ref.kind, ref.name) for ref in retired_workloads(reference_deployment())]
    assert single == [("StatefulSet", "minimax-m25-master"), ("StatefulSet", "minimax-m25-etcd")]
    ha = [(ref.kind, ref.name) for ref in retired_workloads(resource_with({"enabled": True}))]
    assert ha == [("Deployment", "minimax-m25-master")]
    external = resource_with({"enabled": True, "etcd": {"external": {"endpoints": ["e:2379"]}}})
    retired = {(r.kind, r.name) for r in retired_workloads(external)}
    assert ("StatefulSet", "minimax-m25-etcd") in retired
    rendered = {(m["kind"], m["metadata"]["name"]) for m in render_all(external, owner_uid=None)}
    assert not rendered & retired


# --- the leader, from the masters' own view -------------------------------------------------------------


def pod(name: str, uid: str = "") -> PodInfo:
    return PodInfo(
        name=name,
        uid=uid or f"uid-{name}",
        ready=True,
        terminating=False,
        template_hash="r",
        restarts=0,
        traffic=None,
    )


def observed(resource: MooncakeServing) -> Observation:
    pods = tuple(pod(f"minimax-m25-master-{i}") for i in range(3))
    return Observation(MasterState(True, "3/3 masters ready", None, pods), ReplicaState(2, 2, True, "2/2"))


def test_the_measured_health_body_parses() -> None:
    view = MasterView.parse(LEADER_HEALTH)
    assert view.leads and view.leader_address == "10.0.0.5:50051" and view.view_version == 9
    assert not MasterView.parse(STANDBY_HEALTH).leads


def test_the_leader_is_the_pod_that_says_it_leads() -> None:
    resource = resource_with({"enabled": True})
    views = [MasterView.parse(STANDBY_HEALTH), MasterView.parse(LEADER_HEALTH), None]
    found = leadership.find_leader(resource, observed(resource), views)
    assert found.leader is not None and found.leader.name == "minimax-m25-master-1"
    assert found.observation.master.ready and found.observation.master.pod == found.leader
    assert "minimax-m25-master-1 leads (10.0.0.5:50051, view 9)" in found.observation.master.message


@pytest.mark.parametrize(
    ("views", "message"),
    [
        ([STANDBY_HEALTH, STANDBY_HEALTH, None], "no master leads yet (minimax-m25-master-0: standby"),
        ([LEADER_HEALTH, LEADER_HEALTH, None], "2 masters claim to lead"),
    ],
)
def test_no_single_leader_means_the_master_is_not_ready(
    views: list[dict[str, Any] | None], message: str
) -> None:
    resource = resource_with({"enabled": True})
    parsed = [MasterView.parse(view) if view else None for view in views]
    found = leadership.find_leader(resource, observed(resource), parsed)
    assert found.leader is None and not found.observation.master.ready
    assert message in found.observation.master.message


def leadership_of(name: str | None, address: str = "10.0.0.5:50051") -> leadership.Leadership:
    resource = resource_with({"enabled": True})
    obs = observed(resource)
    if name is None:
        return leadership.Leadership(obs, None, None)
    view = MasterView("leader", True, address, 3)
    return leadership.Leadership(obs, pod(name), view)


def test_failovers_are_counted_when_the_leader_changes() -> None:
    first, message = leadership.track(None, leadership_of("m-0"), now="t0")
    assert first is not None and (first.leader, first.failovers, message) == ("m-0", 0, None)
    during, message = leadership.track(first, leadership_of(None), now="t1")
    assert during == first and message is None  # no leader yet: keep the last one
    after, message = leadership.track(during, leadership_of("m-2", "10.0.0.7:50051"), now="t2")
    assert after is not None and (after.leader, after.failovers, after.last_failover_time) == ("m-2", 1, "t2")
    assert message is not None and "m-2 (10.0.0.7:50051) leads, was m-0 (10.0.0.5:50051)" in message
    same, message = leadership.track(after, leadership_of("m-2", "10.0.0.7:50051"), now="t3")
    assert same == after and message is None
    assert leadership.track(HighAvailabilityStatus(leader="m-0"), None, now="t4") == (None, None)


def test_the_planner_decides_the_leader_and_posts_a_failover_once() -> None:
    """The masters' answers are part of the pass's snapshot; the planner picks the leader, records it, and
    orders the failover event first, once: the decision after the canary run does not repeat it."""
    resource = resource_with({"enabled": True})
    replicas = tuple(pod(name) for name in replica_pod_names(resource))
    masters = tuple(pod(f"minimax-m25-master-{i}") for i in range(3))
    count = len(replicas)
    observation = Observation(
        MasterState(True, "3/3 masters ready", None, masters),
        ReplicaState(count, count, True, "ready", replicas),
    )
    before = HighAvailabilityStatus(leader="minimax-m25-master-0", leader_address="10.0.0.4:50051")
    stored = MooncakeServingStatus(phase="Ready", high_availability=before)
    now = datetime(2026, 1, 1, 0, 1, tzinfo=UTC)
    timing = plan.Timing(retry_delay_seconds=10, inconclusive_retry_seconds=60, leader_check_seconds=30)
    views = (MasterView.parse(STANDBY_HEALTH), MasterView.parse(LEADER_HEALTH), None)
    rendering = choose.rendering(resource, stored, None, ())
    snapshot = plan.Snapshot(resource, stored, rendering, observation, now, timing, master_views=views)
    first = plan.decide(snapshot)
    failover = PostEvent(
        "MasterFailover",
        "store master failover: minimax-m25-master-1 (10.0.0.5:50051) leads, was minimax-m25-master-0 "
        "(10.0.0.4:50051); failover 1; the canary runs again",
        "Warning",
    )
    assert first.actions[0] == failover
    tracked = first.status.high_availability
    assert tracked is not None
    assert (tracked.leader, tracked.failovers, tracked.last_failover_time) == (
        "minimax-m25-master-1",
        1,
        "2026-01-01T00:01:00Z",
    )
    order = first.canary
    assert order is not None and order.target.master_leader == "minimax-m25-master-1"
    assert order.target.master_pod == "uid-minimax-m25-master-1"
    run = CanaryStatus(run_id="r", verdict="Passed", finished_at="2026-01-01T00:01:30Z", target=order.target)
    after = plan.decide(snapshot, CanaryRun(run), now=now)
    assert failover not in after.actions
    assert after.status.high_availability == tracked and after.status.phase == "Ready"
    # Who leads is asked over HTTP, not watched: the decision tells the worker when to ask again.
    assert after.outcome is not None and after.outcome.leader_check_in == timing.leader_check_seconds
    # A single master: nobody to ask, no leader recorded.
    single = dataclasses.replace(snapshot, master_views=None)
    assert plan.decide(single).status.high_availability is None


def test_a_leader_change_makes_the_canary_due() -> None:
    def target(leader_pod: str) -> Any:
        return schedule.current_target(
            revision="r",
            generation=1,
            replica_pods=[],
            master_pod="uid",
            master_restarts=0,
            rerun=None,
            master_leader=leader_pod,
        )

    last = CanaryStatus(
        run_id="x", verdict="Passed", finished_at="2026-01-01T00:00:00Z", target=target("m-0")
    )
    now = datetime(2026, 1, 1, 0, 1, tzinfo=UTC)
    why = schedule.canary_due(
        last, target("m-1"), now=now, interval_seconds=None, inconclusive_retry_seconds=60
    )
    assert why == "the store master failed over (leader m-0 -> m-1)"
    assert (
        schedule.canary_due(
            last, target("m-0"), now=now, interval_seconds=None, inconclusive_retry_seconds=60
        )
        is None
    )


# --- the sandbox command ------------------------------------------------------------------------------


def test_the_sandbox_ha_flags_parse_and_no_oplog_needs_master_ha(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["sandbox", "--master-ha", "--no-oplog"])
    assert (args.master_ha, args.no_oplog) == (True, True)
    alone = build_parser().parse_args(["sandbox", "--no-oplog"])
    assert sandbox_command._run(alone) == sandbox_command.ExitCode.USAGE_OR_ENVIRONMENT  # before any install
    assert "--no-oplog needs --master-ha" in capsys.readouterr().err


def test_sandbox_options_refuse_a_single_ha_master() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        SandboxOptions(ha_masters=1)


def test_the_run_command_reads_master_endpoints(tmp_path: Path) -> None:
    masters = tmp_path / "masters.yaml"
    masters.write_text("ns/demo: [http://127.0.0.1:9003, http://127.0.0.1:9004]\n")
    args = build_parser().parse_args(["run", "--master-endpoints", str(masters)])
    settings = settings_from(args)
    assert settings.master_endpoints_for("ns", "demo") == ("http://127.0.0.1:9003", "http://127.0.0.1:9004")
    assert settings.master_endpoints_for("ns", "other") is None


def test_the_managed_etcd_admits_this_resources_masters_and_replicas_and_its_members_only() -> None:
    """It has no authentication: any other pod reaching its client port could rewrite master_view."""
    policies = {
        p["metadata"]["name"]: p["spec"]
        for p in network_policies(resource_with({"enabled": True}), owner_uid=None)
    }
    etcd = policies["minimax-m25-etcd"]
    own = {"app.kubernetes.io/instance": "minimax-m25"}
    assert etcd["podSelector"] == {"matchLabels": {**own, "app.kubernetes.io/component": "store-etcd"}}
    assert etcd["ingress"] == [
        {
            "from": [
                {"podSelector": {"matchLabels": {**own, "app.kubernetes.io/component": "store-master"}}},
                {"podSelector": {"matchLabels": {**own, "app.kubernetes.io/component": "engine"}}},
            ],
            "ports": [{"protocol": "TCP", "port": 2379}],
        },
        {
            "from": [{"podSelector": {"matchLabels": {**own, "app.kubernetes.io/component": "store-etcd"}}}],
            "ports": [{"protocol": "TCP", "port": 2380}],
        },
    ]
    external = {"enabled": True, "etcd": {"external": {"endpoints": ["etcd.platform:2379"]}}}
    assert "minimax-m25-etcd" not in {
        p["metadata"]["name"] for p in network_policies(resource_with(external), owner_uid=None)
    }


def test_the_masters_network_policy_lets_the_operator_ask_who_leads() -> None:
    def metrics_rules(resource: MooncakeServing) -> list[dict[str, Any]]:
        policy = network_policies(resource, owner_uid=None)[0]
        return [rule for rule in policy["spec"]["ingress"] if rule["ports"][0]["port"] == 9003]

    assert metrics_rules(reference_deployment()) == []  # the operator never asks a single master
    (rule,) = metrics_rules(resource_with({"enabled": True}))
    assert rule["from"] == [
        {
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "mooncake-operator"}},
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mooncake-system"}},
        }
    ]
