"""The operator's leader probe of highly available masters (`GET /health`) against a master pod that
answers a real view, endlessly, a byte at a time, or compressed: each costs one bounded probe (a
total deadline and a body cap), never the operator's memory or a reconcile stuck on one socket."""

from __future__ import annotations

import asyncio
import json
import time
import tracemalloc
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from tests.support.hostile_http import endless, gzip_bomb, raw_server, response_head

from mooncake_operator.reconcile.act import master_health
from mooncake_operator.reconcile.act.master_health import master_view, master_views

pytestmark = pytest.mark.unit

VIEW = {"status": "ok", "role": "leader", "ha_state": "serving", "service_ready": True, "view_version": 3}
MIB = 1024 * 1024


def _real(method: str, path: str) -> Iterator[bytes]:
    body = json.dumps(VIEW).encode()
    yield response_head(200, {"Content-Type": "application/json", "Content-Length": str(len(body))}) + body


def _endless(method: str, path: str) -> Iterator[bytes]:
    yield response_head(200, {"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    yield from endless()


def _drip(method: str, path: str) -> Iterator[bytes]:
    yield response_head(200, {"Content-Type": "application/json", "Content-Length": "1000000"})
    while True:
        time.sleep(0.2)  # each read well inside any per-read timeout; the whole never ends
        yield b" "


BOMB = gzip_bomb(64 * MIB)  # built before any measurement: the server runs in this process


def _bomb(method: str, path: str) -> Iterator[bytes]:
    yield response_head(200, {"Content-Encoding": "gzip", "Content-Length": str(len(BOMB))}) + BOMB


async def test_a_real_health_body_is_read() -> None:
    with raw_server(_real) as url:
        async with httpx.AsyncClient(trust_env=False) as http:
            [view] = await master_views(http, [url])
    assert view is not None and view.leads and view.view_version == 3


async def test_an_endless_body_stops_at_the_cap_with_bounded_memory() -> None:
    with raw_server(_endless) as url:
        async with httpx.AsyncClient(trust_env=False) as http:
            tracemalloc.start()
            try:
                view = await master_view(http, url)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
    assert view is None
    assert peak < 4 * MIB, f"peak {peak / MIB:.1f} MiB"


async def test_a_body_that_drips_forever_ends_at_the_total_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(master_health, "PROBE_TIMEOUT_S", 1.0)
    with raw_server(_drip) as url:
        async with httpx.AsyncClient(trust_env=False, timeout=5.0) as http:
            started = time.perf_counter()
            view = await master_view(http, url)
            elapsed = time.perf_counter() - started
    assert view is None
    assert elapsed < 4.0  # the 1 s deadline, not the 5 s per read (never reached)


async def test_a_compressed_body_is_refused_unread() -> None:
    with raw_server(_bomb) as url:
        async with httpx.AsyncClient(trust_env=False) as http:
            tracemalloc.start()
            try:
                view = await master_view(http, url)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
    assert view is None
    assert peak < 4 * MIB, f"peak {peak / MIB:.1f} MiB"


class _Streamed(httpx.AsyncByteStream):
    def __init__(self, body: bytes) -> None:
        self.body = body

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.body


async def test_the_masters_are_asked_at_once() -> None:
    """Each master answers only once all three are being asked: asked one after another, each would wait
    out its probe deadline and answer nothing."""
    asked: list[str] = []
    everyone = asyncio.Event()

    async def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.host)
        if len(asked) == 3:
            everyone.set()
        await everyone.wait()
        return httpx.Response(200, stream=_Streamed(json.dumps(VIEW).encode()))

    urls = [f"http://master-{ordinal}:8080" for ordinal in range(3)]
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
        views = await master_views(http, urls)
    assert [view is not None and view.leads for view in views] == [True, True, True]
    assert sorted(asked) == ["master-0", "master-1", "master-2"]
