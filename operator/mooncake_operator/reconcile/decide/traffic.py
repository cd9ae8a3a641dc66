"""Who serves users (the client Service selects `traffic: on`), decided per pod.

A replica pod starts `off` (pod template) and serves only after a passing canary covered it at its
current revision: the run's target lists it as `name=uid`, and a pod's template never changes under one
UID, so the record is per pod instance. Pods keep serving while their UID lives, so a proven revision's
pods serve during an in-place rollout until replaced; a replaced or new pod waits for a pass. A failed
run holds the pods it blames (`outOfTraffic`, by name, until a pass); an inconclusive one changes
nothing. With the canary disabled every pod serves. `act.traffic` writes the labels.
"""

from __future__ import annotations

from collections.abc import Sequence

from mooncake_operator.api.status import MooncakeServingStatus, PodTraffic, TrafficStatus
from mooncake_operator.build.names import TRAFFIC_OFF, TRAFFIC_ON
from mooncake_operator.reconcile.decide.canary_run import CanaryRun
from mooncake_operator.reconcile.decide.observe import Observation, PodInfo, in_set


def previous_traffic(current: MooncakeServingStatus) -> dict[str, PodTraffic]:
    """The last recorded traffic by pod UID (none before the first status write)."""
    if current.traffic is None:
        return {}
    return {entry.uid: entry for entry in current.traffic.pods}


def next_held(current: MooncakeServingStatus, fresh: CanaryRun | None, *, enabled: bool) -> list[str]:
    """Pods held out of traffic by name: a failed run adds the pods it blames, a pass releases all."""
    if not enabled:
        return []
    held = set(current.out_of_traffic)
    if fresh is not None and fresh.canary.verdict == "Passed":
        held = set()
    elif fresh is not None and fresh.canary.verdict == "Failed":
        held |= set(fresh.blamed)
    return sorted(held)


def traffic_entry(pod: PodInfo, serving: bool, reason: str, proven_by: str | None = None) -> PodTraffic:
    """One pod's traffic record: who it is, whether it serves, and why."""
    return PodTraffic(
        name=pod.name,
        uid=pod.uid,
        revision=pod.template_hash,
        serving=serving,
        reason=reason,
        proven_by=proven_by,
        restarts=pod.restarts,
    )


def pod_traffic(
    pod: PodInfo,
    previous: PodTraffic | None,
    fresh: CanaryRun | None,
    held: Sequence[str],
    *,
    enabled: bool,
) -> PodTraffic:
    """Whether one pod serves, and why."""

    def entry(serving: bool, reason: str, proven_by: str | None = None) -> PodTraffic:
        return traffic_entry(pod, serving, reason, proven_by)

    template_hash = pod.template_hash or "unknown"
    previous = unproven_if_restarted(pod, previous)
    if not enabled:
        return entry(True, "canary disabled (spec.canary.enabled: false): serves once Ready")
    if pod.name in held:
        return entry(False, "held: a failed canary blamed this replica; back after a passing run")
    run = fresh.canary if fresh is not None else None
    if run is not None and run.target is not None and pod.identity in run.target.replica_pods:
        if run.verdict == "Passed":
            return entry(
                True, f"proven by canary run {run.run_id} at pod template {template_hash}", run.run_id
            )
        if previous is not None and previous.serving:
            return previous.model_copy(update={"revision": pod.template_hash, "restarts": pod.restarts})
        return entry(
            False, f"not proven: canary run {run.run_id} at pod template {template_hash} was {run.verdict}"
        )
    if previous is not None:
        return previous.model_copy(
            update={"name": pod.name, "revision": pod.template_hash, "restarts": pod.restarts}
        )
    return entry(False, f"new pod at pod template {template_hash}: waits for a canary to prove it")


def unproven_if_restarted(pod: PodInfo, previous: PodTraffic | None) -> PodTraffic | None:
    """A pod whose containers restarted since `previous` was written runs a new engine process under the
    same UID, which no canary proved: out of traffic until one does (its identity, and so the canary's
    target, changed with the restart count). Entries written without a restart count are kept as they are."""
    if previous is None or previous.restarts is None or pod.restarts <= previous.restarts:
        return previous
    return previous.model_copy(
        update={
            "serving": False,
            "proven_by": None,
            "restarts": pod.restarts,
            "reason": f"engine restarted in place (restarts {previous.restarts} -> {pod.restarts}): "
            "waits for a canary to prove it",
        }
    )


def other_set_traffic(
    pod: PodInfo, previous: PodTraffic | None, serving_set: str | None, switched_to: str | None
) -> PodTraffic:
    """A pod of a set the spec is not rendered into: as it was (the serving set during a BlueGreen
    rollout), out once the client Service switched to `switched_to`."""

    def out(reason: str) -> PodTraffic:
        return traffic_entry(pod, False, reason)

    if switched_to is not None:
        return out(f"replaced by replica set {switched_to} (BlueGreen switch); its set is removed")
    previous = unproven_if_restarted(pod, previous)
    if previous is not None:
        return previous.model_copy(
            update={"name": pod.name, "revision": pod.template_hash, "restarts": pod.restarts}
        )
    if serving_set is not None and in_set(pod.name, serving_set):
        # Replaced during a BlueGreen rollout: no canary runs on the serving set until the rollout ends.
        return out(f"new pod of serving set {serving_set} during a BlueGreen rollout: not proven")
    return out("not in the replica set the spec is rendered into; its set is removed")


def next_traffic(
    current: MooncakeServingStatus,
    observation: Observation,
    fresh: CanaryRun | None,
    held: Sequence[str],
    *,
    enabled: bool,
    candidate: str | None = None,
    serving_set: str | None = None,
    switched: bool = False,
    retire: Sequence[str] = (),
) -> TrafficStatus:
    """Every live replica pod (terminating ones are leaving the Service anyway), by name: the active
    set's, then the other sets'. A BlueGreen `candidate`'s pods stay out until the switch (`switched`);
    an InPlace rollout's `retire` pods leave now (they are replaced, or removed, once out)."""
    previous = previous_traffic(current)
    pods = []
    for pod in observation.replicas.pods:
        if pod.terminating:
            continue
        entry = pod_traffic(pod, previous.get(pod.uid), fresh, held, enabled=enabled)
        if candidate is not None and not switched and entry.serving:
            reason = f"BlueGreen candidate set {candidate}: serves from the switch on"
            entry = entry.model_copy(update={"serving": False, "reason": reason})
        if pod.name in retire:
            reason = "leaving: the InPlace rollout replaces or removes this pod once it is out of traffic"
            entry = entry.model_copy(update={"serving": False, "reason": reason, "proven_by": None})
        pods.append(entry)
    switched_to = candidate if switched else None
    pods += [
        other_set_traffic(pod, previous.get(pod.uid), serving_set, switched_to)
        for pod in observation.others
        if not pod.terminating
    ]
    return TrafficStatus(serving=sum(1 for pod in pods if pod.serving), pods=pods)


def label_changes(observation: Observation, traffic: TrafficStatus) -> dict[str, str]:
    """Pod name -> the label value it must get, for pods whose label differs."""
    labels = {pod.name: pod.traffic for pod in (*observation.replicas.pods, *observation.others)}
    wanted = {entry.name: TRAFFIC_ON if entry.serving else TRAFFIC_OFF for entry in traffic.pods}
    return {name: value for name, value in wanted.items() if labels.get(name) != value}
