"""Asks highly available masters who leads: every master pod's `GET /health` at once, each bounded in
time and size (a silent or endless master costs one bounded probe). `decide.leadership` reads the
answers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import httpx

from mooncake_operator.reconcile.decide.leadership import HEALTH_PATH, MasterView

PROBE_TIMEOUT_S = 3.0  # the whole probe: connect, headers and body
HEALTH_BODY_CAP = 64 * 1024


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
