"""Canary overhead: wall time of a run against the sum of its request latencies.

The canary should add nothing but its requests (per pair two chat completions and two metrics
reads, one after another). Against loopback fake replicas (tests/support/fake_vllm.py) with a fixed
per-chat latency, this reports, per configuration, the median and worst ratio wall / latency sum
and the absolute overhead (wall - latency sum). Target: ratio <= 1.05 plus a few milliseconds.

    .venv/bin/python bench/canary.py [--runs 20] [--latency-ms 0 20 100] [--replicas 2 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.support

import httpx
from tests.support.fake_vllm import FakeCluster

from mooncake_operator.canary.models import CanaryConfig, Verdict
from mooncake_operator.canary.runner import run_canary


async def measure(replicas: int, latency_s: float, runs: int) -> tuple[list[float], list[float], list[float]]:
    """(wall, latency sum, overhead) per run, all in seconds; one warm-up run first (connections)."""
    walls, sums, overheads = [], [], []
    with FakeCluster.start(replicas, latency_s=latency_s) as cluster:
        config = CanaryConfig(replicas=cluster.urls, block_size=32, eagle=True)
        async with httpx.AsyncClient(trust_env=False) as client:
            await run_canary(config, client=client)
            for _ in range(runs):
                result = await run_canary(config, client=client)
                if result.verdict is not Verdict.PASSED:
                    raise SystemExit(f"benchmark run did not pass: {result.reason}")
                walls.append(result.wall_s)
                sums.append(result.request_latency_s)
                overheads.append(result.wall_s - result.request_latency_s)
    return walls, sums, overheads


HEADER = (
    "replicas  chat latency  runs  median wall  median ratio  worst ratio"
    "  median overhead  p90 overhead  worst overhead"
)
TARGET_RATIO = 1.05
TARGET_SLACK_S = 0.005


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 20.0, 100.0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    print(HEADER)
    met = True
    for replicas in args.replicas:
        for latency_ms in args.latency_ms:
            walls, sums, overheads = asyncio.run(measure(replicas, latency_ms / 1000, args.runs))
            ratios = [wall / total for wall, total in zip(walls, sums, strict=True)]
            p90 = statistics.quantiles(overheads, n=10)[-1]
            print(
                f"{replicas:>8}  {latency_ms:>9.0f} ms  {args.runs:>4}"
                f"  {statistics.median(walls) * 1000:>8.1f} ms"
                f"  {statistics.median(ratios):>12.3f}  {max(ratios):>11.3f}"
                f"  {statistics.median(overheads) * 1000:>12.2f} ms  {p90 * 1000:>9.2f} ms"
                f"  {max(overheads) * 1000:>11.2f} ms"
            )
            # The typical run must meet the target; single outliers on a shared machine are reported above.
            excess = statistics.median(
                wall - TARGET_RATIO * total for wall, total in zip(walls, sums, strict=True)
            )
            met = met and excess <= TARGET_SLACK_S
    print(f"target (median run) wall <= {TARGET_RATIO} x latency sum + 5 ms: {'met' if met else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
