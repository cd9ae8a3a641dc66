"""Highly available masters: which one leads, read from the masters themselves, and what a change means.

The operator asks every master pod's `/health` (through the masters' headless Service, or the operator's
master-endpoint override) and takes as leader the pod that says it leads and serves. It never infers
the leader from pod readiness: a standby is Ready too. The master condition is True while a leader
serves; the leader's pod becomes `Observation.master.pod`, and the leader's name goes into the canary's
target, so a failover makes the canary due (`proof.canary_due`). `track` counts failovers for the status
and words the event. The reconcile asks (`master_views`); the planner decides (`decide`, `track`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace

import httpx

from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.api.status import HighAvailabilityStatus
from mooncake_operator.build.names import ChildNames
from mooncake_operator.master_health import HEALTH_PATH, MasterView
from mooncake_operator.reconcile.observe import MasterState, Observation, PodInfo

PROBE_TIMEOUT_S = 3.0  # the whole probe: connect, headers and body
HEALTH_BODY_CAP = 64 * 1024


@dataclass(frozen=True)
class Leadership:
    observation: Observation  # its master state decided by the leader
    leader: PodInfo | None
    view: MasterView | None  # the leader's own view


async def master_views(http: httpx.AsyncClient, urls: Sequence[str]) -> list[MasterView | None]:
    """Each master's /health, by ordinal, asked at once (a silent master costs one PROBE_TIMEOUT_S, not
    one each); None where it did not answer with a view."""
    return list(await asyncio.gather(*(master_view(http, url) for url in urls)))


async def master_view(http: httpx.AsyncClient, url: str) -> MasterView | None:
    """One master's /health within PROBE_TIMEOUT_S in all and HEALTH_BODY_CAP bytes (the real body is
    ~150 bytes): a pod that answers endlessly, or a byte at a time, costs one bounded probe."""
    body = bytearray()
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            headers = {"Accept-Encoding": "identity"}
            request = http.build_request("GET", url.rstrip("/") + HEALTH_PATH, headers=headers)
            response = await http.send(request, stream=True)
            try:
                if response.headers.get("content-encoding", "identity").lower() != "identity":
                    return None  # asked for identity: a compressed body could expand past the cap
                async for chunk in response.aiter_raw():
                    body += chunk
                    if len(body) > HEALTH_BODY_CAP:
                        return None
            finally:
                await response.aclose()
    except (httpx.HTTPError, TimeoutError):
        return None
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    return MasterView.parse(payload) if isinstance(payload, dict) else None


def decide(
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
