"""An engine restarted in place (the container restarts, the pod keeps its UID) is a new process no
canary proved: it leaves user traffic and the canary runs again (found by the fault tier's scenario 2,
tests/faults: the restarted replica served users again as soon as it was Ready, with no canary)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from mooncake_operator.api.status import (
    CanaryStatus,
    CanaryTarget,
    MooncakeServingStatus,
    PodTraffic,
    TrafficStatus,
)
from mooncake_operator.reconcile.decide.canary_run import CanaryRun
from mooncake_operator.reconcile.decide.observe import (
    MasterState,
    Observation,
    PodInfo,
    ReplicaState,
    pod_info,
)
from mooncake_operator.reconcile.decide.schedule import canary_due
from mooncake_operator.reconcile.decide.traffic import label_changes, next_traffic, pod_traffic

pytestmark = pytest.mark.unit

NOW = datetime(2026, 12, 2, 8, 0, tzinfo=UTC)


def replica(restarts: int, traffic: str = "on") -> PodInfo:
    return PodInfo("demo-replica-0", "uid-0", True, False, "hash-1", restarts, traffic)


def proven(restarts: int | None) -> PodTraffic:
    return PodTraffic(
        name="demo-replica-0",
        uid="uid-0",
        revision="hash-1",
        serving=True,
        reason="proven by canary run run-1",
        proven_by="run-1",
        restarts=restarts,
    )


def target(*pods: PodInfo) -> CanaryTarget:
    return CanaryTarget(
        revision="rev",
        generation=1,
        replica_pods=[p.identity for p in pods],
        master_pod="m",
        master_restarts=0,
    )


def test_identity_names_the_engine_process_once_restarted() -> None:
    assert replica(0).identity == "demo-replica-0=uid-0"
    assert replica(2).identity == "demo-replica-0=uid-0#2"
    listed = pod_info(
        {
            "metadata": {"name": "demo-replica-0", "uid": "uid-0"},
            "status": {"containerStatuses": [{"name": "engine", "restartCount": 1}]},
        }
    )
    assert listed.identity == "demo-replica-0=uid-0#1"


def test_a_restart_in_place_makes_the_canary_due_and_says_so() -> None:
    last = CanaryStatus(
        run_id="run-1",
        verdict="Passed",
        reason="ok",
        finished_at="2026-12-02T07:59:00Z",
        target=target(replica(0)),
    )
    why = canary_due(last, target(replica(1)), now=NOW, interval_seconds=None, inconclusive_retry_seconds=60)
    assert why == "replica engines restarted in place: demo-replica-0"
    replaced = PodInfo("demo-replica-0", "uid-new", True, False, "hash-1", 0, "off")
    why = canary_due(last, target(replaced), now=NOW, interval_seconds=None, inconclusive_retry_seconds=60)
    assert why == "replica pods replaced: demo-replica-0"


def test_a_restarted_engine_leaves_traffic_until_a_canary_proves_it() -> None:
    entry = pod_traffic(replica(1), proven(0), None, [], enabled=True)
    assert not entry.serving
    assert entry.restarts == 1
    assert "restarted in place (restarts 0 -> 1)" in entry.reason
    # The next pass (its own entry as the previous one): still out, no canary yet.
    again = pod_traffic(replica(1), entry, None, [], enabled=True)
    assert not again.serving


def test_an_inconclusive_run_over_the_restarted_engine_does_not_put_it_back() -> None:
    run = CanaryStatus(run_id="run-2", verdict="Inconclusive", reason="no hit", target=target(replica(1)))
    entry = pod_traffic(replica(1), proven(0), CanaryRun(run), [], enabled=True)
    assert not entry.serving


def test_a_pass_covering_the_restarted_engine_proves_it() -> None:
    run = CanaryStatus(run_id="run-2", verdict="Passed", reason="ok", target=target(replica(1)))
    out = pod_traffic(replica(1), proven(0), None, [], enabled=True)
    entry = pod_traffic(replica(1), out, CanaryRun(run), [], enabled=True)
    assert entry.serving and entry.proven_by == "run-2" and entry.restarts == 1


def test_a_proven_pod_that_did_not_restart_keeps_serving_and_records_its_count() -> None:
    entry = pod_traffic(replica(3), proven(3), None, [], enabled=True)
    assert entry.serving and entry.proven_by == "run-1" and entry.restarts == 3
    # Written by an operator that recorded no restart count: kept (the target's identity still changes).
    legacy = pod_traffic(replica(1), proven(None), None, [], enabled=True)
    assert legacy.serving and legacy.restarts == 1


def test_next_traffic_takes_the_restarted_pod_out_of_the_service() -> None:
    pod = replica(1)
    observation = Observation(MasterState(True, "ok", None), ReplicaState(1, 1, True, "1/1", (pod,)))
    current = MooncakeServingStatus(traffic=TrafficStatus(serving=1, pods=[proven(0)]))
    traffic = next_traffic(current, observation, None, [], enabled=True)
    assert traffic.serving == 0
    assert label_changes(observation, traffic) == {"demo-replica-0": "off"}
