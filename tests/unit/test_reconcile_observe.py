"""Readiness from workloads and pods: rolled out and Ready, of the current revision, nothing extra."""

from __future__ import annotations

from typing import Any

import pytest

from mooncake_operator.api.examples import reference_deployment
from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.build.names import TRAFFIC_LABEL, replica_pod_names
from mooncake_operator.reconcile.decide.observe import in_set, master_state, pod_info, replica_state

pytestmark = pytest.mark.unit


def pod(
    name: str, *, ready: bool = True, template_hash: str = "rev-2", restarts: int = 0, **meta: Any
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "labels": {"controller-revision-hash": template_hash, TRAFFIC_LABEL: "on"},
            **meta,
        },
        "status": {
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [{"name": "c", "restartCount": restarts}],
        },
    }


def workload(generation: int = 2, observed: int = 2, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": 1},
        "status": {"observedGeneration": observed, **status},
    }


RESOURCE: MooncakeServing = reference_deployment()  # 2 replicas, named minimax-m25


def test_pod_info_reads_readiness_template_hash_restarts_and_traffic() -> None:
    info = pod_info(pod("p", restarts=2, deletionTimestamp="now"))
    assert (info.ready, info.terminating, info.template_hash, info.restarts, info.traffic) == (
        True,
        True,
        "rev-2",
        2,
        "on",
    )
    # A restarted pod runs a new engine process: its identity says so (a canary must prove it again).
    assert info.identity == "p=uid-p#2"


def test_the_master_is_ready_once_rolled_out_with_a_ready_pod() -> None:
    deployment = workload(updatedReplicas=1)
    ready = master_state(deployment, [pod("m-1")])
    assert ready.ready and ready.pod is not None and ready.pod.uid == "uid-m-1"
    assert not master_state(None, []).ready
    assert master_state(workload(observed=1, updatedReplicas=1), [pod("m-1")]).message.endswith(
        "not yet observed"
    )
    assert not master_state(workload(updatedReplicas=0), [pod("m-1")]).ready
    assert master_state(deployment, [pod("m-1", ready=False)]).message == "master pod not ready"
    assert master_state(deployment, []).message == "master pod not created yet"
    # Recreate: an old pod still terminating does not count, the new one does.
    replaced = master_state(deployment, [pod("m-0", deletionTimestamp="t"), pod("m-1")])
    assert replaced.ready and replaced.pod is not None and replaced.pod.name == "m-1"


def test_replicas_are_ready_when_every_pod_is_ready_at_the_current_template() -> None:
    sts = workload(updateRevision="rev-2")
    names = replica_pod_names(RESOURCE)
    state = replica_state(RESOURCE, sts, [pod(name) for name in names])
    assert state.all_ready and state.ready == 2 and state.message == "2/2 replicas ready"
    rolling = replica_state(RESOURCE, sts, [pod(names[0]), pod(names[1], template_hash="rev-1")])
    assert not rolling.all_ready
    assert rolling.message == f"1/2 replicas ready; previous pod template: {names[1]}"
    missing = replica_state(RESOURCE, sts, [pod(names[0])])
    assert missing.message == f"1/2 replicas ready; not created yet: {names[1]}"
    unready = replica_state(RESOURCE, sts, [pod(names[0]), pod(names[1], ready=False)])
    assert unready.message == f"1/2 replicas ready; not ready: {names[1]}"
    extra = replica_state(RESOURCE, sts, [*(pod(n) for n in names), pod("minimax-m25-replica-2")])
    assert not extra.all_ready and "scaling down: minimax-m25-replica-2" in extra.message
    assert not replica_state(RESOURCE, workload(observed=1, updateRevision="rev-2"), []).all_ready
    assert replica_state(RESOURCE, None, []).message == "replica StatefulSet not found"


def test_pods_belong_to_their_own_replica_set_only() -> None:
    assert in_set("demo-replica-0", "demo-replica")
    assert in_set("demo-replica-12", "demo-replica")
    assert not in_set("demo-r1a2b3c4-0", "demo-replica")
    assert in_set("demo-r1a2b3c4-0", "demo-r1a2b3c4")
    assert not in_set("demo-replica-0", "demo-r1a2b3c4")
    # An all-digit template prefix does not make the first set's pattern match it.
    assert not in_set("demo-r1234567-0", "demo-r")
    assert not in_set("demo-replica", "demo-replica")
