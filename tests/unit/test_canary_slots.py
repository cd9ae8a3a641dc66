"""Canaries of many tenants share the operator: one namespace whose replicas never answer holds at most
its share of the slots, each for at most the run's deadline, and a spec cannot ask for a request timeout
over the operator's ceiling."""

from __future__ import annotations

import asyncio

import pytest

from mooncake_operator.api.examples import reference_deployment
from mooncake_operator.canary import policy as canary_policy
from mooncake_operator.reconcile.act.slots import CanarySlots
from mooncake_operator.runtime.settings import OperatorSettings, SettingsError

pytestmark = pytest.mark.unit


async def test_a_namespace_holds_at_most_its_share_and_others_still_run() -> None:
    slots = CanarySlots(total=3, per_namespace=2)
    stuck = asyncio.Event()  # never set: replicas that accept and never answer
    running: dict[str, int] = {"tenant-a": 0, "tenant-b": 0}

    async def canary(namespace: str) -> None:
        async with slots.held(namespace):
            running[namespace] += 1
            if namespace == "tenant-a":
                await stuck.wait()

    hung = [asyncio.create_task(canary("tenant-a")) for _ in range(5)]
    await asyncio.sleep(0.05)
    assert running["tenant-a"] == 2  # not all 3 slots
    await asyncio.wait_for(canary("tenant-b"), timeout=5)  # another tenant is not starved
    assert running["tenant-b"] == 1
    for task in hung:
        task.cancel()
    await asyncio.gather(*hung, return_exceptions=True)
    assert slots._namespaces == {}  # idle namespaces are forgotten


async def test_a_run_past_its_deadline_is_ended_and_frees_its_slot() -> None:
    slots = CanarySlots(total=1, per_namespace=1)

    async def never() -> str:
        await asyncio.Event().wait()
        return "answered"

    async def quick() -> str:
        return "answered"

    assert await slots.run("ns", 0.1, never) is None
    assert await asyncio.wait_for(slots.run("ns", 5, quick), timeout=5) == "answered"


def test_the_request_timeout_is_lowered_to_the_operators_ceiling() -> None:
    wire = reference_deployment().spec.to_wire()
    wire["canary"] = {**wire["canary"], "timeoutSeconds": 10**9}
    spec = type(reference_deployment().spec).model_validate(wire)
    config, notes = OperatorSettings().limit_canary(
        canary_policy.canary_config(spec, ["http://a:8000", "http://b:8000"])
    )
    assert config.request_timeout_s == 600
    assert notes == [
        "spec.canary.timeoutSeconds 1000000000 lowered to the operator's ceiling 600 "
        "(--canary-max-timeout-seconds)"
    ]
    with pytest.raises(SettingsError, match="max-concurrent-canaries-per-namespace must be at least 1"):
        OperatorSettings(max_concurrent_canaries_per_namespace=0)
