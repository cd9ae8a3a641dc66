"""One operator at a time: leader election on a coordination.k8s.io/v1 Lease.

Two operator processes (a second release, `replicas: 2`, a rollout overlapping the old pod) would
reconcile and canary the same replicas at once. Before kopf starts, the process takes the Lease (or waits
for it, idle, retrying every `retry_seconds`); while it runs, it renews the Lease every third of its
duration; when it has not renewed for two thirds of it (another process took over, or the API server
is gone) it stops the operator and exits non-zero, before the Lease can expire for anyone else, so it
never reconciles without the Lease. A clean stop releases the Lease, so a standby takes over within one
retry instead of waiting for it to expire.

Writes are conditional on the Lease's resourceVersion (a merge patch carrying it), so two candidates that
both see an expired Lease cannot both take it: the API server answers the second with 409 Conflict.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from mooncake_operator.kube.client import KubeClient
from mooncake_operator.kube.errors import KubeApiError, KubeError
from mooncake_operator.runtime.settings import SettingsError

logger = logging.getLogger("mooncake_operator.runtime.lease")

LEASE_API_VERSION = "coordination.k8s.io/v1"
LEASE_KIND = "Lease"
DEFAULT_LEASE_DURATION_SECONDS = 15
# At 6 s the leader renews every 2 s (a standby's retry period) and stops after 4 s without an answer:
# shorter leaves a slow API server no room. Past an hour, a dead leader's Lease idles standbys too long.
MIN_LEASE_DURATION_SECONDS = 6
MAX_LEASE_DURATION_SECONDS = 3600


def default_identity() -> str:
    """The pod name when the chart sets POD_NAME, else host and pid (unique per process on a host)."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class LeaseSettings:
    namespace: str
    name: str = "mooncake-operator"
    identity: str = ""
    # The one timing users set (`run --lease-duration-seconds`); the Lease's leaseDurationSeconds.
    duration_seconds: int = DEFAULT_LEASE_DURATION_SECONDS
    retry_seconds: float = 2.0  # a standby's (and a failed take's) wait before trying again

    def __post_init__(self) -> None:
        if not MIN_LEASE_DURATION_SECONDS <= self.duration_seconds <= MAX_LEASE_DURATION_SECONDS:
            raise SettingsError(
                f"lease-duration-seconds must be between {MIN_LEASE_DURATION_SECONDS} and "
                f"{MAX_LEASE_DURATION_SECONDS}, not {self.duration_seconds}"
            )

    @property
    def renew_seconds(self) -> float:
        """How often the leader renews: three renewals fit in one duration."""
        return self.duration_seconds / 3

    @property
    def renew_deadline_seconds(self) -> float:
        """How long the leader goes on without a renewal before it stops: two renewal periods, leaving one
        third of the duration to stop before the Lease expires for the others."""
        return self.duration_seconds - self.renew_seconds


class LeadershipLost(Exception):
    """The Lease could not be renewed in time: another process may be reconciling now."""


def _micro_time(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def holder_of(lease: dict[str, Any] | None, now: datetime) -> str | None:
    """Who holds `lease` now; None when nobody does (no Lease, released, or expired)."""
    spec = (lease or {}).get("spec") or {}
    holder = spec.get("holderIdentity")
    renewed = _parse_time(spec.get("renewTime") or spec.get("acquireTime"))
    duration = spec.get("leaseDurationSeconds")
    if not holder or renewed is None or not isinstance(duration, int | float):
        return None
    return str(holder) if renewed + timedelta(seconds=float(duration)) > now else None


class LeaderElector:
    def __init__(
        self,
        kube: KubeClient,
        settings: LeaseSettings,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.identity = settings.identity or default_identity()
        self.clock = clock
        self.sleep = sleep

    async def try_acquire(self) -> tuple[bool, str | None]:
        """(True, us) when we hold the Lease now (taken or renewed); else (False, the holder)."""
        s = self.settings
        now = self.clock()
        lease = await self.kube.get_or_none(LEASE_API_VERSION, LEASE_KIND, s.name, s.namespace)
        holder = holder_of(lease, now)
        if holder is not None and holder != self.identity:
            return False, holder
        spec: dict[str, Any] = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": s.duration_seconds,
            "renewTime": _micro_time(now),
        }
        try:
            if lease is None:
                spec["acquireTime"] = _micro_time(now)
                spec["leaseTransitions"] = 0
                body = {
                    "apiVersion": LEASE_API_VERSION,
                    "kind": LEASE_KIND,
                    "metadata": {"name": s.name, "namespace": s.namespace},
                    "spec": spec,
                }
                await self.kube.create(body)
            else:
                if holder != self.identity:
                    spec["acquireTime"] = _micro_time(now)
                    spec["leaseTransitions"] = int((lease.get("spec") or {}).get("leaseTransitions") or 0) + 1
                # The resourceVersion makes the patch conditional: a concurrent writer gets 409.
                patch = {"metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]}, "spec": spec}
                await self.kube.patch_merge(LEASE_API_VERSION, LEASE_KIND, s.name, patch, s.namespace)
        except KubeApiError as error:
            if error.status == 409:  # someone else wrote first
                return False, None
            raise
        return True, self.identity

    async def acquire(self) -> None:
        """Wait, idle, until this process holds the Lease."""
        s = self.settings
        announced: str | None = None
        while True:
            try:
                acquired, holder = await self.try_acquire()
            except KubeError as error:
                logger.warning("lease %s/%s: %s; retrying", s.namespace, s.name, error)
                acquired, holder = False, None
            if acquired:
                logger.info("lease %s/%s acquired by %s: reconciling", s.namespace, s.name, self.identity)
                return
            if holder is not None and holder != announced:
                logger.info(
                    "standby: lease %s/%s is held by %s; %s waits and reconciles nothing",
                    s.namespace,
                    s.name,
                    holder,
                    self.identity,
                )
                announced = holder
            await self.sleep(s.retry_seconds)

    async def keep(self) -> None:
        """Renew until cancelled; raises LeadershipLost when another process holds the Lease, or when no
        renewal has succeeded for the renew deadline."""
        s = self.settings
        last_renewed = self.clock()
        while True:
            await self.sleep(s.renew_seconds)
            # A renewal that has not answered by the deadline counts as failed: an API server that
            # accepts connections but never answers must not keep this process leading past it.
            started = self.clock()
            left = s.renew_deadline_seconds - (started - last_renewed).total_seconds()
            try:
                async with asyncio.timeout(max(left, 0.0)):
                    renewed, holder = await self.try_acquire()
            except (KubeError, TimeoutError) as error:
                reason = error if isinstance(error, KubeError) else "no answer before the renew deadline"
                logger.warning("lease %s/%s: renewal failed: %s", s.namespace, s.name, reason)
                renewed, holder = False, None
            now = self.clock()
            if renewed:
                # The renewTime written is about when the renewal started: count from there, not from
                # its answer, so a slow answer cannot carry this process past the Lease's expiry.
                last_renewed = started
            elif holder is not None:
                raise LeadershipLost(f"lease {s.namespace}/{s.name} is now held by {holder}")
            # Stop before the Lease can expire for others: they may take it once it has.
            elif (now - last_renewed).total_seconds() >= s.renew_deadline_seconds:
                raise LeadershipLost(
                    f"lease {s.namespace}/{s.name} not renewed for {s.renew_deadline_seconds:g} s "
                    f"(two thirds of its duration, --lease-duration-seconds {s.duration_seconds})"
                )

    async def release(self) -> None:
        """Give the Lease up (if still ours) so a standby takes over at once; errors are only logged."""
        s = self.settings
        try:
            lease = await self.kube.get_or_none(LEASE_API_VERSION, LEASE_KIND, s.name, s.namespace)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            patch = {
                "metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]},
                "spec": {"holderIdentity": None, "renewTime": None, "acquireTime": None},
            }
            await self.kube.patch_merge(LEASE_API_VERSION, LEASE_KIND, s.name, patch, s.namespace)
            logger.info("lease %s/%s released by %s", s.namespace, s.name, self.identity)
        except KubeError as error:
            logger.warning(
                "lease %s/%s: release failed (it expires by itself): %s", s.namespace, s.name, error
            )
