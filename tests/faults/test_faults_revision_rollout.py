"""Scenario 8: not a fault but the riskiest change users make, a new model revision rolled out under the
client load, once `InPlace` and once `BlueGreen` (docs/operator.md, "Rollout strategies"), on the
customer's resource after scenarios 1-6 (this file sorts after test_faults_on_pods.py): a second resource
would run two more engines beside it on the shared node, and BlueGreen already runs four.

Each test rolls the resource from the tiny target's revision it serves to the other one (the first from
revision 1 to 2, the second back to 1), so each starts from Ready on a known revision and may run alone.
Users send the customer's model name, which every revision serves (the CPU example's alias), and get the
old revision's answer until the new one is proven, then the new one's (`AnswerChange`); the answers
measured per revision are kept, so the second test checks both against the first's."""

from __future__ import annotations

import time
from typing import Any

from tests.support import cluster
from tests.support.fault_load import OVERLOADED, replica_pods, wait_until
from tests.support.fault_rollout import (
    TrafficSample,
    bluegreen_violations,
    replica_sets,
    roll_out,
    rolled_out_after,
    sample_traffic,
    unserved_seconds,
)
from tests.support.fault_scenarios import (
    AnswerChange,
    client_endpoints,
    report,
    run_scenario,
    status_of,
)

from mooncake_operator.reconcile.decide.observe import in_set
from mooncake_sandbox.models import TARGET_REVISIONS

# The old set's pods leave after the switch: the preStop drain (5 s, then until vLLM is idle) and the
# engine's shutdown; the pod's grace period (pod.drainSeconds 300 + 30) bounds it.
OLD_SET_GONE_TIMEOUT = 400.0
# The answer (hash) users got from each model path, as measured by a scenario here.
ANSWERS: dict[str, str] = {}


def serving_model(name: str) -> str:
    model: str = cluster.get_serving(name)["spec"]["model"]["name"]
    return model


def other_revision(model: str) -> str:
    paths = [cluster.target_path(revision) for revision in TARGET_REVISIONS]
    assert model in paths, f"the resource serves {model}, none of the tiny target's revisions {paths}"
    (other,) = [path for path in paths if path != model]
    return other


def rollout(name: str, strategy: str, samples: list[TrafficSample]) -> dict[str, Any]:
    """Roll the resource to the other revision with `strategy` under the load, sampling who serves."""
    before = serving_model(name)
    target = other_revision(before)
    revision_before = status_of(name)["desiredRevision"]

    def sample() -> None:
        samples.append(sample_traffic(name))

    def inject() -> None:
        sample()  # the client Service as it was, right before the change
        roll_out(name, target, strategy)

    result = run_scenario(
        f"new model revision rolled out {strategy}",
        name,
        inject,
        lambda moment: rolled_out_after(name, moment, target, revision_before),
        on_poll=sample,
        change=AnswerChange(before=ANSWERS.get(before), after=ANSWERS.get(target)),
    )
    ANSWERS[before], ANSWERS[target] = result["answer_before"], result["answer_after"]
    return result


def test_new_revision_rolled_out_in_place_keeps_a_proven_replica_serving(serving: str) -> None:
    old_pods = {p["metadata"]["name"]: p["metadata"]["uid"] for p in replica_pods(serving)}
    samples: list[TrafficSample] = []
    result = rollout(serving, "InPlace", samples)
    nobody_served = unserved_seconds(samples)
    report(
        {
            "scenario": "new model revision rolled out InPlace (who served)",
            "nobody_served_s": round(nobody_served, 1),
            "min_serving": min((len(s.endpoints) for s in samples), default=0),
            "samples": len(samples),
        }
    )
    # InPlace's promise (maxUnavailable 1, maxSurge 1): a proven pod serves in every sample, each old
    # pod leaves the client Service before it is replaced, so no user request fails.
    assert samples and nobody_served == 0, f"the client Service was empty for {nobody_served:.1f} s"
    errors = set(result["failed_statuses"]) - {OVERLOADED}
    assert not errors, f"users saw failures during an InPlace rollout: {result['failed_statuses']}"
    assert not any(s.candidate_set for s in samples), "InPlace started a second replica set"
    serving_sets = {s.serving_set for s in samples}
    assert len(serving_sets) == 1, f"InPlace switched replica sets: {serving_sets}"
    now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in replica_pods(serving)}
    assert sorted(now) == sorted(old_pods), (
        f"InPlace ended on other pods (the surge pod left?): {sorted(now)}"
    )
    assert not set(now.values()) & set(old_pods.values()), f"a pod was not replaced: {old_pods} -> {now}"


def test_new_revision_rolled_out_blue_green_keeps_the_old_set_serving_until_proven(serving: str) -> None:
    old_set = (status_of(serving).get("rollout") or {}).get("servingSet")
    assert old_set, f"status.rollout.servingSet unset before the rollout: {status_of(serving).get('rollout')}"
    desired = cluster.get_serving(serving)["spec"]["replicas"]
    samples: list[TrafficSample] = []
    result = rollout(serving, "BlueGreen", samples)
    # One more look after the load's tail: the switch is seen even if it came between the last poll's
    # sample and its probe (and the client Service must not be empty then either).
    samples.append(sample_traffic(serving))
    rollout_status = status_of(serving).get("rollout") or {}
    new_set = rollout_status.get("servingSet")
    candidates = sorted({s.candidate_set for s in samples if s.candidate_set})
    switch_seen = next((s.at for s in samples if s.serving_set == new_set != old_set), None)

    # Then the old set leaves: its StatefulSet and every pod of it.
    def old_set_gone() -> bool:
        pods = [p["metadata"]["name"] for p in replica_pods(serving)]
        return old_set not in replica_sets(serving) and not any(in_set(pod, old_set) for pod in pods)

    wait_until(f"{old_set} removed after the switch", old_set_gone, OLD_SET_GONE_TIMEOUT)
    report(
        {
            "scenario": "new model revision rolled out BlueGreen (old set removed)",
            # An upper bound: from the first sample that saw the switch (the load's tail in between).
            "old_set_gone_within_s": None
            if switch_seen is None
            else round(time.monotonic() - switch_seen, 1),
            "candidates": candidates,
            "samples": len(samples),
        }
    )
    # BlueGreen's promise: the old set serves at full size until the new one passed, so no user request
    # fails (ticks skipped at 8 in flight are saturation, measured, not failures of the rollout).
    errors = set(result["failed_statuses"]) - {OVERLOADED}
    assert not errors, f"users saw failures during a BlueGreen rollout: {result['failed_statuses']}"
    violations = bluegreen_violations(samples, old_set, desired)
    assert not violations, "\n".join(violations[:10])
    assert new_set in candidates, f"did not switch to the candidate {candidates}: {rollout_status}"
    assert not rollout_status.get("candidateSet"), rollout_status
    new_pods = {
        p["status"].get("podIP") for p in replica_pods(serving) if in_set(p["metadata"]["name"], new_set)
    }
    endpoints = set(client_endpoints(serving))
    assert len(new_pods) == desired and endpoints == new_pods, (
        f"the client Service routes to {sorted(endpoints)}, not {new_set}'s pods {sorted(new_pods)}"
    )
