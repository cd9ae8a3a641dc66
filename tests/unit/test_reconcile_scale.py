"""Scaling (`kubectl scale mcs`, an HPA or KEDA through the /scale subresource): a new replica joins user
traffic only after a canary covered it, like any rollout; the replicas already proven keep serving."""

from __future__ import annotations

import pytest
from tests.unit.test_reconcile_plan import MASTER, labels, pod, run, snapshot, stored, summary

from mooncake_operator.api.group import API_VERSION, KIND
from mooncake_operator.api.resource import MooncakeServing, parse_resource
from mooncake_operator.build.digests import spec_hash
from mooncake_operator.build.names import TRAFFIC_ON
from mooncake_operator.reconcile.decide import plan
from mooncake_operator.reconcile.decide.actions import Decision
from mooncake_operator.reconcile.decide.canary_run import CanaryRun
from mooncake_operator.reconcile.decide.observe import MasterState, Observation, ReplicaState
from mooncake_operator.reconcile.decide.revisions import LastGood

pytestmark = pytest.mark.unit


def scaled(replicas: int) -> MooncakeServing:
    return parse_resource(
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": "demo", "namespace": "ns", "generation": 3},
            "spec": {
                "model": {"name": "tiny", "revision": "r1"},
                "engine": {"image": "registry.invalid/vllm-mooncake:2", "blockSize": 32},
                "replicas": replicas,
                "store": {"globalSegmentSize": "1GB", "localBufferSize": "512MB"},
            },
        }
    )


TWO, THREE = scaled(2), scaled(3)
AT_TWO, AT_THREE = spec_hash(TWO.spec), spec_hash(THREE.spec)
# The two replicas serve, proven by run-1 at the two-replica revision; replica 2 is the scale-up's.
P0, P1, P2 = pod(0, traffic="on"), pod(1, traffic="on"), pod(2)


def decide(fresh: CanaryRun | None) -> Decision:
    current = stored(P0, P1, canary=run("Passed", P0, P1, revision=AT_TWO, run_id="run-1"), last_good=AT_TWO)
    replicas = ReplicaState(3, 3, True, "3/3 ready", (P0, P1, P2))
    observed = Observation(MasterState(True, "master ready", MASTER), replicas)
    return plan.decide(snapshot(THREE, current, observed, LastGood(AT_TWO, TWO.spec)), fresh)


def test_a_new_replica_waits_for_a_canary_and_the_proven_ones_keep_serving() -> None:
    before = decide(fresh=None)
    assert before.canary is not None, "scaling up must order a canary that covers the new replica"
    assert before.canary.target.replica_pods == [P0.identity, P1.identity, P2.identity]
    assert before.status.phase == "Canary"
    assert P2.name not in labels(before)  # it started off and stays off
    assert summary(before.actions) == (
        ("status", "Canary", "CanaryRunning"),
        ("event", "CanaryRunning", "Normal"),
        ("canary", AT_THREE),
    )
    serving = (
        {entry.name for entry in before.status.traffic.pods if entry.serving}
        if before.status.traffic
        else set()
    )
    assert serving == {P0.name, P1.name}
    assert before.status.selector == "app.kubernetes.io/component=engine,app.kubernetes.io/instance=demo"


def test_the_canary_covering_the_new_replica_puts_it_in_traffic() -> None:
    after = decide(fresh=CanaryRun(run("Passed", P0, P1, P2, revision=AT_THREE, run_id="run-2")))
    assert labels(after) == {P2.name: TRAFFIC_ON}
    assert summary(after.actions) == (
        ("record", AT_THREE),
        ("status", "Ready", "Ready"),
        ("event", "Ready", "Normal"),
        ("traffic", {P2.name: TRAFFIC_ON}),
    )
    assert after.status.phase == "Ready"
    assert after.status.traffic is not None and after.status.traffic.serving == 3
