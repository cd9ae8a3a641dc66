"""Readiness of the master and the replicas, read from the workloads and their pods (pure over manifests;
`act.snapshot` reads them from the watch cache).

Ready means rolled out *and* Ready: the master Deployment has observed its generation, its pods are all of
the current template and one is Ready; every replica pod NAME-replica-<i> exists, is Ready, is not being
deleted and runs the StatefulSet's current pod template (its updateRevision). Pod UIDs and the master's
restart count are kept: they are what the canary triggers compare.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.build.names import LABEL_COMPONENT, TRAFFIC_LABEL, replica_pod_names

# The pod template a pod runs (a ControllerRevision of its StatefulSet): not the spec revision, nor the
# model's.
TEMPLATE_HASH_LABEL = "controller-revision-hash"


@dataclass(frozen=True)
class PodInfo:
    name: str
    uid: str
    ready: bool
    terminating: bool
    template_hash: str | None  # TEMPLATE_HASH_LABEL
    restarts: int
    traffic: str | None
    ip: str | None = None  # status.podIP: where the canary reaches this very pod

    @property
    def identity(self) -> str:
        """What a canary's proof covers: the pod instance and, once restarted, its engine process (an
        engine restarted in place is a new process under the same UID)."""
        return f"{self.name}={self.uid}" + (f"#{self.restarts}" if self.restarts else "")


@dataclass(frozen=True)
class MasterState:
    ready: bool
    message: str
    pod: PodInfo | None = None  # with highly available masters: the leader's pod (decide.leadership)
    pods: tuple[PodInfo, ...] = ()  # every master pod found, ordered by name


@dataclass(frozen=True)
class ReplicaState:
    desired: int
    ready: int
    rolled_out: bool
    message: str
    pods: tuple[PodInfo, ...] = ()  # every replica pod found, ordered by name
    expected: int | None = None  # during an InPlace rollout: the new pods the canary proves

    @property
    def all_ready(self) -> bool:
        return self.rolled_out and self.ready == (self.desired if self.expected is None else self.expected)


@dataclass(frozen=True)
class RolloutView:
    """An InPlace rollout as readiness sees it: the pods of the new template (what the canary proves),
    the pods kept at their template, and what keeps the new pods from being proven (empty: nothing)."""

    new: tuple[str, ...]
    kept: tuple[str, ...]
    waiting: str = ""


@dataclass(frozen=True)
class LiveSet:
    """A replica StatefulSet of the resource, as found: its template annotation (None: applied before
    sets carried one) and, for the InPlace rollout's planner, its replicas, partition, whether its
    controller observed its generation, the template hash its updated pods carry, and its pods."""

    name: str
    template: str | None
    replicas: int = 0
    partition: int | None = None
    observed: bool = False
    update_revision: str | None = None
    pods: tuple[PodInfo, ...] = ()


def live_set(
    stateful_set: Mapping[str, Any], pods: Sequence[Mapping[str, Any]], template: str | None
) -> LiveSet:
    spec = stateful_set.get("spec") or {}
    status = stateful_set.get("status") or {}
    rolling = (spec.get("updateStrategy") or {}).get("rollingUpdate") or {}
    partition = rolling.get("partition")
    return LiveSet(
        name=name_of(stateful_set),
        template=template,
        replicas=int(spec.get("replicas") or 0),
        partition=int(partition) if partition is not None else None,
        observed=_generation_observed(stateful_set),
        update_revision=status.get("updateRevision"),
        pods=tuple(sorted((pod_info(pod) for pod in pods), key=lambda info: info.name)),
    )


@dataclass(frozen=True)
class Observation:
    master: MasterState
    replicas: ReplicaState  # the set rendered from the spec (the active one)
    # Replica pods of the resource's other sets: the serving set while a BlueGreen candidate is proven,
    # or sets on their way out. Ordered by name.
    others: tuple[PodInfo, ...] = ()
    # Pods the client Service selects that no StatefulSet of this resource created: they get user
    # traffic nobody proved. Names, ordered, at most MAX_FOREIGN_NAMES.
    foreign: tuple[str, ...] = ()

    @property
    def ready(self) -> bool:
        return self.master.ready and self.replicas.all_ready

    @property
    def has_pods(self) -> bool:
        return self.master.pod is not None or bool(self.replicas.pods)


def pod_info(pod: Mapping[str, Any]) -> PodInfo:
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    labels = metadata.get("labels") or {}
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    restarts = sum(int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or [])
    return PodInfo(
        name=str(metadata.get("name", "")),
        uid=str(metadata.get("uid", "")),
        ready=ready,
        terminating=metadata.get("deletionTimestamp") is not None,
        template_hash=labels.get(TEMPLATE_HASH_LABEL),
        restarts=restarts,
        traffic=labels.get(TRAFFIC_LABEL),
        ip=status.get("podIP") or None,
    )


def _generation_observed(workload: Mapping[str, Any]) -> bool:
    generation = (workload.get("metadata") or {}).get("generation")
    observed = (workload.get("status") or {}).get("observedGeneration")
    return generation is not None and observed is not None and observed >= generation


def master_state(deployment: Mapping[str, Any] | None, pods: Sequence[Mapping[str, Any]]) -> MasterState:
    if deployment is None:
        return MasterState(False, "master Deployment not found")
    infos = [pod_info(pod) for pod in pods]
    live = [info for info in infos if not info.terminating]
    ready_pod = next((info for info in live if info.ready), None)
    shown = ready_pod or (live[0] if live else None)
    status = deployment.get("status") or {}
    desired = (deployment.get("spec") or {}).get("replicas", 1)
    if not _generation_observed(deployment):
        return MasterState(False, "master Deployment: rollout not yet observed", shown)
    if status.get("updatedReplicas", 0) < desired or len(live) > desired:
        return MasterState(False, "master Deployment: rollout in progress", shown)
    if ready_pod is None:
        return MasterState(False, "master pod not ready" if live else "master pod not created yet", shown)
    return MasterState(True, f"master pod {ready_pod.name} ready", ready_pod)


def ha_master_rollout_state(
    resource: MooncakeServing, stateful_set: Mapping[str, Any] | None, pods: Sequence[Mapping[str, Any]]
) -> MasterState:
    """Highly available masters, before asking who leads: rolled out, and every master pod Ready (a
    standby is Ready too: it runs and takes part in the election). `leadership.find_leader` then decides."""
    infos = tuple(sorted((pod_info(pod) for pod in pods), key=lambda info: info.name))
    if stateful_set is None:
        return MasterState(False, "master StatefulSet not found", None, infos)
    update_template_hash = (stateful_set.get("status") or {}).get("updateRevision")
    if not _generation_observed(stateful_set) or update_template_hash is None:
        return MasterState(False, "master StatefulSet: rollout not yet observed", None, infos)
    desired = resource.spec.store.master.high_availability.replicas
    live = [info for info in infos if not info.terminating]
    ready = [info for info in live if info.ready and info.template_hash == update_template_hash]
    if len(ready) < desired:
        return MasterState(False, f"{len(ready)}/{desired} masters ready", None, infos)
    return MasterState(True, f"{desired}/{desired} masters ready", None, infos)


def replica_state(
    resource: MooncakeServing,
    stateful_set: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]],
    replica_set: str | None = None,
    *,
    rollout: RolloutView | None = None,
) -> ReplicaState:
    """The set `replica_set` (default NAME-replica): `pods` are that set's. During an InPlace rollout
    (`rollout`), the pods the canary proves are the set's new ones; the others keep their template."""
    desired = resource.spec.replicas
    names = replica_pod_names(resource, replica_set)
    kept: tuple[str, ...] = ()
    if rollout is not None:
        names, kept = list(rollout.new), rollout.kept
    infos = tuple(sorted((pod_info(pod) for pod in pods), key=lambda info: info.name))
    if stateful_set is None:
        return ReplicaState(desired, 0, False, "replica StatefulSet not found", infos)
    update_template_hash = (stateful_set.get("status") or {}).get("updateRevision")
    if not _generation_observed(stateful_set) or update_template_hash is None:
        return ReplicaState(desired, 0, False, "replica StatefulSet: rollout not yet observed", infos)
    by_name = {info.name: info for info in infos}
    current = [by_name.get(name) for name in names]
    ready = [
        info
        for info in current
        if info is not None
        and info.ready
        and not info.terminating
        and info.template_hash == update_template_hash
    ]
    ready_names = {info.name for info in ready}
    missing = [name for name, info in zip(names, current, strict=True) if not info]
    outdated = [
        info.name for info in current if info is not None and info.template_hash != update_template_hash
    ]
    extra = sorted(set(by_name) - set(names) - set(kept))
    problems = []
    if rollout is not None and rollout.waiting:
        problems.append(rollout.waiting)
    if missing:
        problems.append(f"not created yet: {', '.join(missing)}")
    if outdated:
        problems.append(f"previous pod template: {', '.join(outdated)}")
    unready = [
        info.name
        for info in current
        if info is not None and info.template_hash == update_template_hash and info.name not in ready_names
    ]
    if unready:
        problems.append(f"not ready: {', '.join(unready)}")
    if extra:
        problems.append(f"scaling down: {', '.join(extra)}")
    if rollout is None:
        message = f"{len(ready)}/{desired} replicas ready"
    else:
        message = f"{len(ready)}/{len(names)} replicas of the new pod template ready"
    if problems:
        message += "; " + "; ".join(problems)
    rolled_out = not (outdated or extra or missing or (rollout is not None and rollout.waiting))
    expected = len(names) if rollout is not None else None
    return ReplicaState(desired, len(ready), rolled_out, message, infos, expected)


def in_set(pod_name: str, replica_set: str) -> bool:
    """A StatefulSet's pods are SET-<ordinal>. (NAME-replica-0 is not NAME-r1a2b3c4-0's, nor the reverse.)"""
    ordinal = pod_name.removeprefix(f"{replica_set}-")
    return ordinal != pod_name and ordinal.isdigit()


def name_of(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


def component_of(pod: Mapping[str, Any]) -> str | None:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_COMPONENT)
