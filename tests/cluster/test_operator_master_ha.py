"""Highly available masters against a real API server: the children pass a server-side dry run, and the
operator follows the leader the masters report, counts failovers, posts an event and re-runs the canary.

The masters here are fake admin endpoints (tests.support.fake_masters) answering /health as
mooncake_master 0.3.13.post1 does in HA mode; the real election is proven by the e2e tier.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
from tests.cluster.operator_harness import (
    FakeKubelet,
    condition,
    events,
    eventually,
    get_serving,
    run_operator,
    serving,
    wait_for_phase,
)
from tests.support.fake_masters import FakeMasters
from tests.support.fake_vllm import FakeCluster

from mooncake_operator.api.group import API_VERSION, KIND
from mooncake_operator.api.resource import parse_resource
from mooncake_operator.build.disruption import POLICY_V1, POLICY_V1BETA1
from mooncake_operator.build.manifests import render_all
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.runtime.settings import OperatorSettings

MANAGER = "operator-tests"
HA_EXTERNAL = {"enabled": True, "etcd": {"external": {"endpoints": ["etcd.invalid:2379"]}}}


def ha_serving(namespace: str, ha: dict[str, Any]) -> dict[str, Any]:
    return serving(namespace, store={"globalSegmentSize": "1GB", "master": {"highAvailability": ha}})


@pytest.fixture
def masters() -> Iterator[FakeMasters]:
    fake = FakeMasters(3)
    yield fake
    fake.close()


@pytest.mark.parametrize(
    "ha",
    [
        {"enabled": True, "etcd": {"managed": {"replicas": 3, "storageSize": "2Gi"}}},
        {
            "enabled": True,
            "replicas": 5,
            "etcd": {
                "external": {"endpoints": ["etcd-0.infra.svc:2379"], "tls": {"caSecretRef": {"name": "ca"}}}
            },
        },
    ],
    ids=["managed-etcd", "external-tls-etcd"],
)
async def test_ha_children_pass_a_server_side_dry_run(
    kube: KubeClient, namespace: str, crd: None, ha: dict[str, Any]
) -> None:
    owner = await kube.create(ha_serving(namespace, ha), field_manager=MANAGER)
    resource = parse_resource(owner)
    served = await kube.served_versions("policy")  # the test API server may predate policy/v1
    policy = POLICY_V1 if "v1" in served else POLICY_V1BETA1
    children = render_all(resource, owner_uid=owner["metadata"]["uid"], policy_api_version=policy)
    assert ("apps/v1", "StatefulSet", "demo-master") in [
        (c["apiVersion"], c["kind"], c["metadata"]["name"]) for c in children
    ]
    for child in children:
        answered = await kube.apply(child, field_manager=MANAGER, dry_run=True)
        assert answered["metadata"]["name"] == child["metadata"]["name"]
    assert await kube.get_or_none("apps/v1", "StatefulSet", "demo-master", namespace) is None


async def test_the_operator_follows_the_leader_and_recanaries_on_a_failover(
    kube: KubeClient,
    namespace: str,
    crd: None,
    fakes: FakeCluster,
    settings: OperatorSettings,
    masters: FakeMasters,
) -> None:
    settings = dataclasses.replace(settings, master_endpoints={f"{namespace}/demo": tuple(masters.urls)})
    masters.lead(0, view=2)
    with run_operator(settings):
        async with FakeKubelet(kube, namespace):
            # Start with the single master, then switch to highly available masters.
            await kube.create(serving(namespace))
            await wait_for_phase(kube, namespace, "Ready", within=60)
            await kube.patch_merge(
                API_VERSION,
                KIND,
                "demo",
                {"spec": {"store": {"master": {"highAvailability": HA_EXTERNAL}}}},
                namespace,
            )

            async def ready_with(leader: str, failovers: int) -> dict[str, Any] | None:
                body = await get_serving(kube, namespace)
                status = body.get("status") or {}
                ha = status.get("highAvailability") or {}
                target = ((status.get("canary") or {}).get("target")) or {}
                matches = (ha.get("leader"), ha.get("failovers"), target.get("masterLeader")) == (
                    leader,
                    failovers,
                    leader,
                )
                return body if matches and status.get("phase") == "Ready" else None

            first = await eventually(
                lambda: ready_with("demo-master-0", 0), within=60, what="Ready, master-0 leads"
            )
            assert first["status"]["highAvailability"]["leaderAddress"] == "10.0.0.10:50051"
            # The single master's Deployment is retired: scaled to zero (the operator holds no delete).
            retired = await kube.get("apps/v1", "Deployment", "demo-master", namespace)
            assert retired["spec"]["replicas"] == 0
            statefulset = await kube.get("apps/v1", "StatefulSet", "demo-master", namespace)
            assert statefulset["spec"]["replicas"] == 3

            # The leader dies; while the standbys elect, no master leads: MasterReady goes False.
            masters.kill(0)
            masters.lead(None, view=5)

            async def no_leader() -> dict[str, Any] | None:
                body = await get_serving(kube, namespace)
                master = condition(body, "MasterReady") if body.get("status") else {}
                return (
                    body
                    if master.get("status") == "False" and "no master leads" in master["message"]
                    else None
                )

            await eventually(no_leader, within=30, what="MasterReady False while no master leads")

            masters.lead(2, view=9)
            after = await eventually(
                lambda: ready_with("demo-master-2", 1), within=60, what="master-2 leads, re-proven"
            )
            assert after["status"]["canary"]["runId"] != first["status"]["canary"]["runId"]
            assert after["status"]["highAvailability"]["lastFailoverTime"]
            failovers = [e for e in await events(kube, namespace) if e["reason"] == "MasterFailover"]
            assert (
                len(failovers) == 1
                and "demo-master-2 (10.0.0.12:50051) leads, was demo-master-0" in (failovers[0]["message"])
            )
