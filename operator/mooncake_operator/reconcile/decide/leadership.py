"""Highly available masters: which one leads, read from the masters themselves, and what a change means
(pure; `act.master_health` asks them).

The operator asks every master pod's `/health` (through the masters' headless Service, or the operator's
master-endpoint override) and takes as leader the pod that says it leads and serves. It never infers
the leader from pod readiness: a standby is Ready too. The master condition is True while a leader
serves; the leader's pod becomes `Observation.master.pod`, and the leader's name goes into the canary's
target, so a failover makes the canary due (`schedule.canary_due`). `track` counts failovers for the
status and words the event.

A mooncake_master's own view of the election is its `GET /health` on the metrics port. Measured on
mooncake-transfer-engine-non-cuda 0.3.13.post1 (`-enable_ha`), every master answers 200:

    {"status":"ok","role":"leader","ha_state":"serving","service_ready":true,
     "leader_address":"10.0.0.5:50051","view_version":9}

and a standby `"role":"standby","service_ready":false` with the same `leader_address`. The leader's
address is what it publishes in etcd (`mooncake-store/<cluster_id>/master_view`) and what the store
clients connect to. The view version grows with every election (by more than one per failover, so it
is no failover count).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.api.status import HighAvailabilityStatus
from mooncake_operator.build.names import ChildNames
from mooncake_operator.reconcile.decide.observe import MasterState, Observation, PodInfo

HEALTH_PATH = "/health"


@dataclass(frozen=True)
class MasterView:
    role: str  # "leader", "standby"; "" when absent (a master without -enable_ha)
    serving: bool
    leader_address: str | None
    view_version: int | None

    @property
    def leads(self) -> bool:
        """Leads and serves (a fresh leader spends a few seconds in warm-up before it serves)."""
        return self.role == "leader" and self.serving

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> MasterView:
        version = body.get("view_version")
        leader = body.get("leader_address")
        return cls(
            role=str(body.get("role") or ""),
            serving=body.get("service_ready") is True,
            leader_address=str(leader) if leader else None,
            view_version=version if isinstance(version, int) and not isinstance(version, bool) else None,
        )


@dataclass(frozen=True)
class Leadership:
    observation: Observation  # its master state decided by the leader
    leader: PodInfo | None
    view: MasterView | None  # the leader's own view


def find_leader(
    resource: MooncakeServing, observation: Observation, views: Sequence[MasterView | None]
) -> Leadership:
    """The leader among the master pods, from their views (pure). Master i answers for pod NAME-master-i."""
    names = ChildNames.of(resource.metadata.name)
    pods = {pod.name: pod for pod in observation.master.pods if not pod.terminating}
    claims = [
        (pods[f"{names.master}-{ordinal}"], view)
        for ordinal, view in enumerate(views)
        if view is not None and view.leads and f"{names.master}-{ordinal}" in pods
    ]
    rollout = observation.master.message
    if len(claims) == 1:
        pod, view = claims[0]
        message = f"{pod.name} leads ({view.leader_address}, view {view.view_version}); {rollout}"
        master = MasterState(True, message, pod, observation.master.pods)
        return Leadership(replace(observation, master=master), pod, view)
    if claims:
        claimants = ", ".join(pod.name for pod, _ in claims)
        why = f"{len(claims)} masters claim to lead ({claimants}): election in progress"
    else:
        roles = [
            f"{names.master}-{ordinal}: {view.role or 'no role'}"
            if view
            else f"{names.master}-{ordinal}: no answer"
            for ordinal, view in enumerate(views)
        ]
        why = f"no master leads yet ({', '.join(roles)})"
    master = MasterState(False, f"{why}; {rollout}", None, observation.master.pods)
    return Leadership(replace(observation, master=master), None, None)


def track(
    previous: HighAvailabilityStatus | None, leadership: Leadership | None, *, now: str
) -> tuple[HighAvailabilityStatus | None, str | None]:
    """The status after this observation, and the failover event's message when the leader changed.

    While no master leads, the last leader stays in the status (the failover is counted when the next
    one is seen). A leader is the same when its pod name and the address it publishes are."""
    if leadership is None:
        return None, None
    before = previous or HighAvailabilityStatus()
    leader, view = leadership.leader, leadership.view
    if leader is None or view is None:
        return before, None
    current = HighAvailabilityStatus(
        leader=leader.name,
        leader_address=view.leader_address,
        view_version=view.view_version,
        failovers=before.failovers,
        last_failover_time=before.last_failover_time,
    )
    changed = before.leader is not None and (
        before.leader != current.leader or before.leader_address != current.leader_address
    )
    if not changed:
        return current, None
    current = current.model_copy(update={"failovers": before.failovers + 1, "last_failover_time": now})
    message = (
        f"store master failover: {current.leader} ({current.leader_address}) leads, was {before.leader} "
        f"({before.leader_address}); failover {current.failovers}; the canary runs again"
    )
    return current, message
