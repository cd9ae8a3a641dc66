"""The writer's put lag on real engines, as the canary meets it, and a canary pair's cost with per-request
evidence.

    flock /tmp/heavy.lock .venv/bin/python bench/put_lag.py [--runs 10]

One sandbox (real mooncake_master, two real vLLM CPU replicas on the patched engine, Eagle-3 as the
reference deployment, started with the operator's engine arguments: `--enable-prompt-tokens-details` and
`--per-request-spec-decode-metrics summary`). Each run is one canary pair A -> B with a fresh salt, the
configured request only. vLLM's MooncakeStore connector stores the cold request's blocks from a sending
thread that no request waits for; before the warm request, the canary reads the writer's
`mooncake_store` counters until its `save_put` keys cover the prompt's full blocks (`canary/runner.py`,
`wait_for_puts`). Reported per run: how long that wait took after the cold answer (`waited_s`, the lag
as seen through the metrics endpoint: at most one read late), how many reads it took, and the pair's
cost (chat requests, metrics reads, wall time), with where the reader's load was proven from (the warm
answer's own `cached_tokens`, or the counters).

Re-executes itself in a loopback-only network namespace. JSON on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from typing import Any

from mooncake_operator.canary.models import CanaryConfig
from mooncake_operator.canary.runner import run_canary
from mooncake_sandbox import EngineMode, SandboxOptions, netns, prepare, start_sandbox


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "min": round(min(values), 4),
        "median": round(statistics.median(values), 4),
        "max": round(max(values), 4),
    }


async def measure(runs: int) -> dict[str, Any]:
    prepared = await asyncio.to_thread(
        prepare, (EngineMode.PATCHED,), log=lambda line: print(line, file=sys.stderr)
    )
    options = SandboxOptions(engine=EngineMode.PATCHED, speculative=True)
    rows: list[dict[str, Any]] = []
    async with start_sandbox(options, prepared=prepared) as sandbox:
        config: CanaryConfig = sandbox.canary_config(eagle=True).model_copy(update={"pairs": "first"})
        for run in range(runs):
            result = await sandbox.guard(run_canary(config))
            (pair,) = result.pairs
            wait = pair.put_wait
            row = {
                "run": run,
                "verdict": pair.verdict.value,
                "put_wait": None if wait is None else wait.outcome.value,
                "waited_s": None if wait is None else round(wait.waited_s, 4),
                "polls": None if wait is None else wait.polls,
                "keys_needed": None if wait is None else wait.keys_needed,
                "hit_evidence": pair.hit_evidence,
                "warm_cached_tokens": None if pair.warm is None else pair.warm.cached_tokens,
                "chat_requests": result.cost.chat_requests,
                "metrics_reads": result.cost.metrics_reads + result.cost.writer_metrics_reads,
                "pair_wall_s": round(pair.wall_s, 3),
                "request_latency_s": round(pair.request_latency_s, 3),
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    waited = [row["waited_s"] for row in rows if row["waited_s"] is not None]
    return {
        "runs": runs,
        "verdicts": sorted({row["verdict"] for row in rows}),
        "hit_evidence": sorted({str(row["hit_evidence"]) for row in rows}),
        "waited_s": _summary(waited) if waited else None,
        "polls": _summary([float(row["polls"]) for row in rows if row["polls"] is not None])
        if waited
        else None,
        "pair_wall_s": _summary([row["pair_wall_s"] for row in rows]),
        "chat_requests_per_pair": sorted({row["chat_requests"] for row in rows}),
        "metrics_reads_per_pair": sorted({row["metrics_reads"] for row in rows}),
        "rows": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=10, help="canary pairs, a fresh salt each (default 10)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if not netns.in_private_netns() and netns.namespaces_permitted():
        netns.exec_in_netns([sys.executable, *sys.argv])
    print(json.dumps(asyncio.run(measure(args.runs)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
