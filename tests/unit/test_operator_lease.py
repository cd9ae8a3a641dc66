"""Leader election against an in-memory Lease endpoint that checks resourceVersion like the API server,
on a fake clock that the elector's sleeps advance."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from mooncake_operator.cli.main import build_parser, main
from mooncake_operator.cli.run import lease_settings_from
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.kube.config import KubeConfig
from mooncake_operator.runtime.lease import LeaderElector, LeadershipLost, LeaseSettings, holder_of
from mooncake_operator.runtime.settings import OperatorSettings, SettingsError

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


class Stop(Exception):
    """Ends a keep() that would renew forever, once the fake clock reached the test's end."""


def elector(
    server: Callable[[httpx.Request], Any],
    identity: str,
    clock: list[datetime],
    *,
    duration: int = 15,
    until: datetime | None = None,
) -> LeaderElector:
    kube = KubeClient(
        KubeConfig(server="https://127.0.0.1:6443", token="t"), transport=httpx.MockTransport(server)
    )

    async def sleep(seconds: float) -> None:
        if until is not None and clock[0] >= until:
            raise Stop
        clock[0] += timedelta(seconds=seconds)
        await asyncio.sleep(0)

    settings = LeaseSettings(namespace="ns", identity=identity, duration_seconds=duration)
    return LeaderElector(kube, settings, clock=lambda: clock[0], sleep=sleep)


def unreachable(
    server: LeaseServer, clock: list[datetime], start: datetime, end: datetime
) -> Callable[[httpx.Request], httpx.Response]:
    """`server`, refusing connections from `start` until (not including) `end` on the fake clock."""

    def handler(request: httpx.Request) -> httpx.Response:
        if start <= clock[0] < end:
            raise httpx.ConnectError("connection refused", request=request)
        return server(request)

    return handler


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


def renewed_at(server: LeaseServer) -> datetime:
    assert server.lease is not None
    return datetime.fromisoformat(server.lease["spec"]["renewTime"].replace("Z", "+00:00"))


async def test_a_longer_lease_rides_out_a_longer_api_server_outage() -> None:
    """45 s: renewals every 15 s, the give-up deadline at 30 s; a 25 s outage right after a renewal fails
    one renewal (at 15 s) and the next (at 30 s) succeeds. With 15 s (deadline 10 s) the same outage
    ends leadership at 10 s, before the Lease could expire for anyone else at 15 s."""
    outage = (T0 + timedelta(seconds=1), T0 + timedelta(seconds=26))
    server, clock = LeaseServer(), [T0]
    patient = elector(
        unreachable(server, clock, *outage), "first", clock, duration=45, until=T0 + timedelta(seconds=60)
    )
    assert await patient.try_acquire() == (True, "first")
    with pytest.raises(Stop):
        await patient.keep()
    assert clock[0] == T0 + timedelta(seconds=60)
    assert renewed_at(server) == T0 + timedelta(seconds=60)  # renewed at 30, 45 and 60 s
    assert server.lease is not None and server.lease["spec"]["leaseDurationSeconds"] == 45

    server, clock = LeaseServer(), [T0]
    hasty = elector(unreachable(server, clock, *outage), "first", clock, duration=15)
    assert await hasty.try_acquire() == (True, "first")
    with pytest.raises(LeadershipLost, match=r"not renewed for 10 s .*--lease-duration-seconds 15\)"):
        await hasty.keep()
    assert clock[0] == T0 + timedelta(seconds=10)
    assert holder_of(server.lease, clock[0]) == "first"  # it stopped while the Lease was still its own


@pytest.mark.parametrize("duration", [15, 45])
async def test_an_outage_of_a_third_of_the_duration_is_ridden_out_wherever_it_starts(duration: int) -> None:
    """At most one renewal (every third of the duration) falls into such an outage: the next succeeds."""
    third = duration / 3
    for start in [step / 2 for step in range(1, round(2 * third) + 1)]:  # every phase of a renewal period
        outage = (T0 + timedelta(seconds=start), T0 + timedelta(seconds=start + third))
        server, clock = LeaseServer(), [T0]
        keeper = elector(
            unreachable(server, clock, *outage),
            "first",
            clock,
            duration=duration,
            until=T0 + timedelta(seconds=3 * duration),
        )
        assert await keeper.try_acquire() == (True, "first")
        with pytest.raises(Stop):
            await keeper.keep()
        assert renewed_at(server) == T0 + timedelta(seconds=3 * duration), start


async def test_a_renewal_the_api_server_never_answers_ends_leadership_by_the_deadline() -> None:
    """An API server that accepts the request and never answers: the renewal is abandoned at the renew
    deadline, not after the client's request timeout (30 s by default, past the Lease's expiry)."""
    server = LeaseServer()
    offset = [timedelta(0)]
    started = time.monotonic()

    def clock() -> datetime:  # real time plus what the elector's sleeps skipped
        return T0 + offset[0] + timedelta(seconds=time.monotonic() - started)

    async def silent_after_the_first_write(request: httpx.Request) -> httpx.Response:
        if server.lease is not None:
            await asyncio.Event().wait()
        return server(request)

    async def sleep(seconds: float) -> None:
        offset[0] += timedelta(seconds=seconds)
        await asyncio.sleep(0)

    kube = KubeClient(
        KubeConfig(server="https://127.0.0.1:6443", token="t"),
        transport=httpx.MockTransport(silent_after_the_first_write),
        timeout=30,
    )
    settings = LeaseSettings(namespace="ns", identity="first", duration_seconds=6)  # deadline 4 s
    keeper = LeaderElector(kube, settings, clock=clock, sleep=sleep)
    assert await keeper.try_acquire() == (True, "first")
    with pytest.raises(LeadershipLost, match="not renewed for 4 s"):
        await asyncio.wait_for(keeper.keep(), timeout=10)
    elapsed = (clock() - T0).total_seconds()
    assert 4 <= elapsed < 5, elapsed  # 2 s asleep, then 2 s waiting for an answer


def test_the_renewal_timings_follow_the_duration() -> None:
    default = LeaseSettings(namespace="ns")
    assert (default.duration_seconds, default.renew_seconds, default.renew_deadline_seconds) == (15, 5, 10)
    longer = LeaseSettings(namespace="ns", duration_seconds=45)
    assert (longer.renew_seconds, longer.renew_deadline_seconds, longer.retry_seconds) == (15, 30, 2)
    assert LeaseSettings(namespace="ns", duration_seconds=6).renew_deadline_seconds == 4
    assert LeaseSettings(namespace="ns", duration_seconds=3600).renew_seconds == 1200


@pytest.mark.parametrize("duration", [0, 5, 3601])
def test_a_duration_outside_6_to_3600_is_refused(duration: int) -> None:
    refusal = f"lease-duration-seconds must be between 6 and 3600, not {duration}"
    with pytest.raises(SettingsError, match=refusal):
        LeaseSettings(namespace="ns", duration_seconds=duration)


def test_the_flag_sets_the_lease_duration() -> None:
    settings = OperatorSettings(kube=KubeConfig(server="https://127.0.0.1:6443", token="t"))
    default = build_parser().parse_args(["run", "--lease-namespace", "ops"])
    assert lease_settings_from(default, settings) == LeaseSettings(namespace="ops", duration_seconds=15)
    longer = build_parser().parse_args(["run", "--lease-namespace", "ops", "--lease-duration-seconds", "45"])
    assert lease_settings_from(longer, settings).duration_seconds == 45


def test_run_refuses_a_bad_duration_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "ctx",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    assert main(["run", f"--kubeconfig={kubeconfig}", "--lease-duration-seconds=5"]) == 3
    assert "lease-duration-seconds must be between 6 and 3600, not 5" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["run", f"--kubeconfig={kubeconfig}", "--lease-duration-seconds=7.5"])
    assert exited.value.code == 3
    assert "invalid int value: '7.5'" in capsys.readouterr().err


class _Unstoppable:
    """kopf with a handler that ignores the stop flag (a canary mid-request): only an exit ends it."""

    def __init__(self) -> None:
        self.stop_flag: asyncio.Event | None = None

    async def __call__(self, **kwargs: Any) -> None:
        self.stop_flag = kwargs["stop_flag"]
        await asyncio.Event().wait()  # never set: the stop flag is not looked at


async def test_a_lost_lease_ends_the_process_before_the_lease_can_pass_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mooncake_operator.cli import run as run_command

    class Elector:
        identity = "op-0"

        def __init__(self, *_: object) -> None:
            pass

        async def acquire(self) -> None:
            return None

        async def keep(self) -> None:
            raise LeadershipLost("lease ns/mooncake-operator not renewed for 4 s")

    class Client:
        def __init__(self, *_: object, **__: object) -> None:
            pass

        async def __aenter__(self) -> Client:
            return self

        async def __aexit__(self, *_: object) -> None:
            return None

    class Exited(Exception):
        pass

    exits: list[tuple[int, float]] = []

    def exit_now(status: int) -> None:
        exits.append((status, time.monotonic()))
        raise Exited

    kopf_operator = _Unstoppable()
    monkeypatch.setattr(run_command, "KubeClient", Client)
    monkeypatch.setattr(run_command, "LeaderElector", Elector)
    monkeypatch.setattr(run_command, "build_registry", lambda settings: None)
    monkeypatch.setattr(run_command.kopf, "operator", kopf_operator)
    monkeypatch.setattr(run_command, "exit_now", exit_now)
    settings = OperatorSettings(kube=KubeConfig(server="https://127.0.0.1:1", token="t"), liveness_port=0)
    lease = LeaseSettings(namespace="ns", duration_seconds=6)  # renew every 2 s, give up after 4 s: 2 s left
    started = time.monotonic()
    with pytest.raises(Exited):
        await run_command.run_as_leader(settings, lease)
    assert kopf_operator.stop_flag is not None and kopf_operator.stop_flag.is_set()  # asked to stop first
    ((status, at),) = exits
    assert status == 1
    # Within what is left of the Lease (2 s), not after the 30 s kopf could take.
    assert at - started < 2.0
