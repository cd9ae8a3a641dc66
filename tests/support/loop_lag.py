"""The canary over fake replicas that all answer one given text, with the caller's event-loop lag measured:
how long the loop could not run anything else while the canary sent, read and judged."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from tests.support.fake_vllm import FakeCluster

from mooncake_operator.canary.models import CanaryConfig, CanaryResult
from mooncake_operator.canary.runner import run_canary

TICK_S = 0.01


def answering(content: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A payload filter for FakeReplica: the chat answer's content becomes `content`."""

    def replace(payload: dict[str, Any]) -> dict[str, Any]:
        choice = {**payload["choices"][0], "message": {"role": "assistant", "content": content}}
        return {**payload, "choices": [choice]}

    return replace


async def canary_with_loop_lag(content: str) -> tuple[CanaryResult, float]:
    """One pair over two replicas answering `content`, and the longest gap of a 10 ms ticker meanwhile."""
    lag = 0.0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal lag
        while not stop.is_set():
            before = time.perf_counter()
            await asyncio.sleep(TICK_S)
            lag = max(lag, time.perf_counter() - before - TICK_S)

    with FakeCluster.start(2) as cluster:
        for replica in cluster.replicas:
            replica.payload_filter = answering(content)
        config = CanaryConfig(
            replicas=cluster.urls, pairs="first", connect_retries=0, block_size=32, eagle=True
        )
        ticking = asyncio.create_task(ticker())
        try:
            result = await run_canary(config)
        finally:
            stop.set()
            await ticking
    return result, lag
