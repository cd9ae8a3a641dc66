"""Leader election against an in-memory Lease endpoint that checks resourceVersion like the API server."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from mooncake_operator.kube import KubeClient, KubeConfig
from mooncake_operator.operator_lease import LeaderElector, LeadershipLost, LeaseSettings, holder_of

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=UTC)


class LeaseServer:
    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            if self.lease is None:
                return httpx.Response(404, json={"kind": "Status", "reason": "NotFound", "code": 404})
            return httpx.Response(200, json=self.lease)
        body = json.loads(request.content)
        if request.method == "POST":
            if self.lease is not None:
                return httpx.Response(409, json={"kind": "Status", "reason": "AlreadyExists", "code": 409})
            self.lease = body
        else:
            assert self.lease is not None
            if body["metadata"]["resourceVersion"] != self.lease["metadata"]["resourceVersion"]:
                return httpx.Response(409, json={"kind": "Status", "reason": "Conflict", "code": 409})
            spec = {**self.lease["spec"], **body["spec"]}
            self.lease = {**self.lease, "spec": {k: v for k, v in spec.items() if v is not None}}
        self.version += 1
        self.lease["metadata"] = {**self.lease["metadata"], "resourceVersion": str(self.version)}
        return httpx.Response(200, json=self.lease)


def elector(server: LeaseServer, identity: str, clock: list[datetime]) -> LeaderElector:
    kube = KubeClient(
        KubeConfig(server="https://127.0.0.1:6443", token="t"), transport=httpx.MockTransport(server)
    )
    settings = LeaseSettings(namespace="ns", identity=identity, renew_seconds=0.01, retry_seconds=0.01)
    return LeaderElector(kube, settings, clock=lambda: clock[0])


async def test_one_holder_at_a_time_until_release_or_expiry() -> None:
    server, clock = LeaseServer(), [T0]
    first, second = elector(server, "first", clock), elector(server, "second", clock)
    assert await first.try_acquire() == (True, "first")
    assert await second.try_acquire() == (False, "first")
    clock[0] = T0 + timedelta(seconds=10)
    assert await first.try_acquire() == (True, "first")  # a renewal
    assert await second.try_acquire() == (False, "first")
    clock[0] = T0 + timedelta(seconds=26)  # 16 s after the last renewal: expired
    assert await second.try_acquire() == (True, "second")
    assert server.lease is not None and server.lease["spec"]["leaseTransitions"] == 1
    assert await first.try_acquire() == (False, "second")
    await second.release()
    assert holder_of(server.lease, clock[0]) is None
    assert await first.try_acquire() == (True, "first")


async def test_a_stale_write_loses_the_race() -> None:
    server, clock = LeaseServer(), [T0]
    first = elector(server, "first", clock)
    assert await first.try_acquire() == (True, "first")
    stale = json.loads(json.dumps(server.lease))
    clock[0] = T0 + timedelta(seconds=20)
    second, third = elector(server, "second", clock), elector(server, "third", clock)
    assert await second.try_acquire() == (True, "second")

    def stale_get(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":  # third read the expired Lease before second wrote
            return httpx.Response(200, json=stale)
        return server(request)

    third.kube = KubeClient(
        KubeConfig(server="https://127.0.0.1:6443", token="t"), transport=httpx.MockTransport(stale_get)
    )
    assert await third.try_acquire() == (False, None)
    assert holder_of(server.lease, clock[0]) == "second"


async def test_keep_stops_when_another_process_holds_the_lease() -> None:
    server, clock = LeaseServer(), [T0]
    first, second = elector(server, "first", clock), elector(server, "second", clock)
    await first.try_acquire()
    clock[0] = T0 + timedelta(seconds=20)
    await second.try_acquire()
    with pytest.raises(LeadershipLost, match="held by second"):
        await first.keep()
