"""What hostile input costs the product: time and peak Python memory (tracemalloc) to refuse it.

- a gzip bomb served as a metrics page (decoded size 256 MiB, ~250 KiB on the wire), read with the
  default 16 MiB metrics cap;
- the billion-laughs YAML alias bomb (~350 bytes) through the product's one YAML loader;
- the canary's duplicate-replica check over 60,000 URLs (the models now bound spec.replicas at 64);
- one 4 MiB chat answer read and parsed: the peak and what is still held after (the answer itself);
- judging answers just under the 4 MiB default chat cap written to hurt the JSON search (a flood of `{`, one
  huge object, a nest deeper than the recursion limit): the search's time, and the longest stall of the
  event loop while `run_canary` judges a pair of them (a 10 ms ticker's worst gap).

    .venv/bin/python bench/hostile_inputs.py
"""

from __future__ import annotations

import asyncio
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.support

import httpx
from tests.support.hostile_http import gzip_bomb, raw_server, response_head
from tests.support.loop_lag import canary_with_loop_lag
from tests.unit.test_safe_yaml import BOMB

from mooncake_operator import safe_yaml
from mooncake_operator.canary.client import CounterScrapeError, chat, scrape_counters
from mooncake_operator.canary.expectations import search_json
from mooncake_operator.canary.models import CanaryConfig
from mooncake_operator.canary.request import reference_request

MIB = 2**20


async def gzip_bomb_metrics() -> str:
    body = gzip_bomb(256 * MIB)

    def respond(method: str, path: str) -> Iterator[bytes]:
        yield response_head(200, {"Content-Encoding": "gzip", "Content-Length": str(len(body))}) + body

    with raw_server(respond) as url:
        async with httpx.AsyncClient(trust_env=False) as client:
            tracemalloc.start()
            started = time.perf_counter()
            try:
                await scrape_counters(client, url, timeout=30)
                outcome = "read (not refused!)"
            except CounterScrapeError as error:
                outcome = f"refused ({error.kind.value})"
            elapsed = time.perf_counter() - started
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    wire = len(body) // 1024
    return (
        f"gzip bomb, {wire} KiB wire / 256 MiB decoded: {outcome} in {elapsed:.3f} s, "
        f"peak {peak / MIB:.1f} MiB"
    )


def yaml_bomb() -> str:
    tracemalloc.start()
    started = time.perf_counter()
    try:
        safe_yaml.load(BOMB)
        outcome = "loaded (not refused!)"
    except safe_yaml.YamlBombError:
        outcome = "refused"
    elapsed = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return (
        f"YAML alias bomb, {len(BOMB)} bytes: {outcome} in {elapsed * 1000:.1f} ms, peak {peak / MIB:.2f} MiB"
    )


def duplicate_check() -> str:
    urls = [f"http://10.0.{index // 250}.{index % 250}:8000" for index in range(60_000)]
    started = time.perf_counter()
    CanaryConfig(replicas=urls)
    return f"duplicate-replica check, 60,000 URLs: {time.perf_counter() - started:.2f} s"


# Sized so the chat body (the answer JSON-escaped, plus the envelope) stays under the 4 MiB default cap.
HOSTILE_ANSWERS = {
    "3.9 MiB of '{'": "{" * (39 * MIB // 10),
    "a 3.9 MiB object": '{"k": [' + "1, " * (13 * MIB // 10) + "1]}",
    "a 2.4 MiB nest": '{"a": ' * (4 * MIB // 10),
}


def json_search() -> list[str]:
    lines = []
    for name, answer in HOSTILE_ANSWERS.items():
        started = time.perf_counter()
        search = search_json(answer)
        lines.append(f"JSON search, {name}: {search.missing()} in {time.perf_counter() - started:.3f} s")
    return lines


async def judging_loop_lag() -> list[str]:
    lines = []
    for name, answer in HOSTILE_ANSWERS.items():
        started = time.perf_counter()
        result, lag = await canary_with_loop_lag(answer)
        lines.append(
            f"canary pair judged, {name}: {result.verdict.value} in {time.perf_counter() - started:.2f} s, "
            f"longest event-loop stall {lag * 1000:.0f} ms"
        )
    return lines


async def chat_answer_memory() -> str:
    from tests.unit.test_canary_memory_ceilings import _chat_body

    body = _chat_body("x" * (4 * MIB))

    def respond(method: str, path: str) -> Iterator[bytes]:
        yield response_head(200, {"Content-Type": "application/json", "Content-Length": str(len(body))})
        for start in range(0, len(body), 64 * 1024):
            yield body[start : start + 64 * 1024]

    with raw_server(respond) as url:
        async with httpx.AsyncClient(trust_env=False) as client:
            tracemalloc.start()
            answer = await chat(
                client, url, reference_request(), cache_salt=None, timeout=60, max_body_bytes=8 * MIB
            )
            held, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
    size = len(body) / MIB
    assert answer.text is not None
    return (
        f"one chat answer, {size:.1f} MiB body: peak {peak / MIB:.1f} MiB, held {held / MIB:.1f} MiB with it"
    )


def main() -> None:
    print(asyncio.run(gzip_bomb_metrics()))
    print(yaml_bomb())
    print(asyncio.run(chat_answer_memory()))
    print(duplicate_check())
    print("\n".join(json_search()))
    print("\n".join(asyncio.run(judging_loop_lag())))


if __name__ == "__main__":
    main()
