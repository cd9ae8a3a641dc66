"""A resource's worker gives way at once when kopf stops it (resource deleted, operator exiting)."""

from __future__ import annotations

import asyncio

import pytest

from mooncake_operator.reconcile.worker import until_stopped

pytestmark = pytest.mark.unit


class Flag:
    """kopf's `stopped` as the timer sees it: something to wait on."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def wait(self) -> asyncio.Future[bool]:
        return asyncio.ensure_future(self.event.wait())


async def test_work_that_finishes_returns_its_result() -> None:
    async def work() -> str:
        return "done"

    assert await until_stopped(work(), Flag()) == "done"


async def test_a_stop_cancels_the_work_in_progress() -> None:
    flag, started, cleaned_up = Flag(), asyncio.Event(), asyncio.Event()

    async def canary() -> str:
        started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned_up.set()
        return "never"

    running = asyncio.create_task(until_stopped(canary(), flag))
    await started.wait()
    flag.event.set()
    assert await asyncio.wait_for(running, timeout=5) is None
    assert cleaned_up.is_set()


async def test_the_work_s_own_error_is_not_swallowed() -> None:
    async def broken() -> None:
        raise RuntimeError("a bug in the reconcile")

    with pytest.raises(RuntimeError, match="a bug in the reconcile"):
        await until_stopped(broken(), Flag())
