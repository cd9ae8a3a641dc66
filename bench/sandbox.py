"""Sandbox performance: start-up, one canary pair, cold vs warm latency, the four-step matrix, peak RSS.

    .venv/bin/python bench/sandbox.py [--runs 3]      # progress on stderr, JSON summary on stdout

Each run is the customer's whole matrix on real engines, timed end to end: start the master and two
Eagle replicas on the buggy engine (time to both healthy), one canary pair A -> B (the customer's
steps 1 and 2), a cold request on B (step 3), both replicas restarted without the speculative config
and a pair (step 4), both restarted on the patched engine and a pair (step 2 fixed). A sampler reads
the resident memory of every process the sandbox runs (master, replicas, their engine cores) twice a
second; the peak is reported. Medians over the runs. Re-executes itself in a loopback-only network
namespace, like `mooncake-operator sandbox`. Targets on 2 cores: healthy <= 60 s, matrix <= 5 min,
peak RSS <= 8 GiB.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from mooncake_operator.canary.client import chat
from mooncake_operator.canary.models import CanaryResult
from mooncake_operator.canary.request import reference_request
from mooncake_operator.canary.runner import run_canary
from mooncake_sandbox import EngineMode, Prepared, Sandbox, SandboxOptions, netns, prepare, start_sandbox

GIB = 1024**3
TARGETS = {"healthy_s": 60.0, "matrix_s": 300.0, "peak_rss_gib": 8.0}


async def _sample_rss(sandbox_box: list[Sandbox], peak: list[int]) -> None:
    while True:
        if sandbox_box:
            peak[0] = max(peak[0], sandbox_box[0].rss_bytes())
        await asyncio.sleep(0.5)


async def _pair(sandbox: Sandbox, *, eagle: bool) -> CanaryResult:
    config = sandbox.canary_config(eagle=eagle)
    return await sandbox.guard(run_canary(config.model_copy(update={"pairs": "first"})))


async def one_run(prepared: Prepared, run_dir: Path) -> dict[str, Any]:
    box: list[Sandbox] = []
    peak = [0]
    sampler = asyncio.create_task(_sample_rss(box, peak))
    started = time.monotonic()
    try:
        options = SandboxOptions(engine=EngineMode.BUGGY, run_dir=run_dir)
        async with start_sandbox(options, prepared=prepared) as sandbox:
            box.append(sandbox)
            healthy_s = time.monotonic() - started
            buggy = await _pair(sandbox, eagle=True)  # steps 1 and 2
            async with httpx.AsyncClient(trust_env=False) as client:  # step 3
                salt = f"bench-{uuid.uuid4().hex}"
                cold_b = await chat(
                    client, sandbox.replica_urls[1], reference_request(), cache_salt=salt, timeout=300
                )
            restart_started = time.monotonic()
            await sandbox.restart_replicas([0, 1], speculative=False)
            restart_s = time.monotonic() - restart_started
            no_eagle = await _pair(sandbox, eagle=False)  # step 4
            await sandbox.restart_replicas([0, 1], speculative=True, engine=EngineMode.PATCHED)
            patched = await _pair(sandbox, eagle=True)
            matrix_s = time.monotonic() - started
            peak[0] = max(peak[0], sandbox.rss_bytes())
    finally:
        sampler.cancel()
    pair = patched.pairs[0]
    assert pair.cold is not None and pair.warm is not None
    return {
        "healthy_s": healthy_s,
        "canary_pair_s": pair.wall_s,
        "cold_latency_s": pair.cold.latency_s,
        "warm_latency_s": pair.warm.latency_s,
        "restart_both_s": restart_s,
        "matrix_s": matrix_s,
        "peak_rss_gib": peak[0] / GIB,
        "verdicts": {
            "buggy": buggy.verdict.value,
            "no_speculative": no_eagle.verdict.value,
            "patched": patched.verdict.value,
        },
        "step3_cold_equals_step1": cold_b.text == (buggy.pairs[0].cold.text if buggy.pairs[0].cold else None),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    numeric = [key for key, value in runs[0].items() if isinstance(value, float)]
    medians = {key: round(statistics.median(run[key] for run in runs), 2) for key in numeric}
    return {
        "runs": len(runs),
        "median": medians,
        "all": [{key: round(run[key], 2) for key in numeric} for run in runs],
        "verdicts": [run["verdicts"] for run in runs],
        "step3_cold_equals_step1": [run["step3_cold_equals_step1"] for run in runs],
        "targets": {key: {"target": limit, "met": medians[key] <= limit} for key, limit in TARGETS.items()},
        "cpus": os.cpu_count(),
        "load_average_at_end": [round(value, 1) for value in os.getloadavg()],
    }


async def main_async(runs: int) -> dict[str, Any]:
    prepared = prepare(tuple(EngineMode), log=lambda line: print(line, file=sys.stderr))
    results = []
    for index in range(runs):
        with tempfile.TemporaryDirectory(prefix="mooncake-bench-") as run_dir:
            print(f"bench: run {index + 1}/{runs}", file=sys.stderr)
            results.append(await one_run(prepared, Path(run_dir)))
            print(f"bench: {json.dumps(results[-1])}", file=sys.stderr)
    return summarize(results)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if not netns.in_private_netns() and netns.namespaces_permitted():
        netns.exec_in_netns([sys.executable, *sys.argv])
    summary = asyncio.run(main_async(args.runs))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
