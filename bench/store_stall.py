"""Provoke and record the store-transfer stall: many warm loads against one running sandbox.

    flock /tmp/heavy.lock .venv/bin/python -m mooncake_operator.netns -- \
        .venv/bin/python bench/store_stall.py --pairs 40 --budget-s 420 [--no-warm-up] [--env GLOG_v=1]

Starts the sandbox once (master + 2 replicas), then runs cold-on-writer / warm-on-reader pairs with
fresh salts, alternating the direction. A warm (or cold) request still in flight after
--threshold-s triggers `py-spy dump --native` of every process of both replicas (API server,
EngineCore, workers), written next to the engine logs in the run directory, which is always kept.
One JSON line per pair on stdout; a summary at the end. Diagnostic only: nothing here is judged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from mooncake_operator.canary import chat, customer_request
from mooncake_operator.netns import in_private_netns
from mooncake_operator.sandbox import SandboxOptions, start_sandbox
from mooncake_operator.sandbox.processes import group_members
from mooncake_operator.sandbox.runtime import Sandbox

REQUEST_TIMEOUT_S = 180.0


def py_spy() -> str:
    found = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if found is None:
        sys.exit("py-spy is missing: .venv/bin/pip install py-spy")
    return found


def dump_all(sandbox: Sandbox, directory: Path, label: str) -> None:
    """py-spy dump (Python + native frames) of every process of every replica."""
    for replica in sandbox.replicas:
        if replica.process is None:
            continue
        for pid in group_members(replica.process.pgid):
            out = directory / f"{label}.{replica.name}.{pid}.txt"
            result = subprocess.run(
                [py_spy(), "dump", "--native", "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            out.write_text(result.stdout + result.stderr)


async def timed_chat(
    sandbox: Sandbox,
    client: httpx.AsyncClient,
    url: str,
    salt: str,
    *,
    threshold_s: float,
    label: str,
) -> tuple[Any, float, int]:
    """One chat; dumps every replica process at threshold_s and every 20 s after while it is in flight."""
    started = time.monotonic()
    task = asyncio.ensure_future(
        chat(client, url, customer_request(), cache_salt=salt, timeout=REQUEST_TIMEOUT_S)
    )
    dumps = 0
    deadline = threshold_s
    while True:
        done, _ = await asyncio.wait({task}, timeout=max(0.0, started + deadline - time.monotonic()))
        if done:
            return task.result(), time.monotonic() - started, dumps
        sandbox.check_alive()
        dumps += 1
        await asyncio.to_thread(dump_all, sandbox, sandbox.run_dir, f"{label}.t{int(deadline)}")
        deadline += 20.0


async def main(args: argparse.Namespace) -> int:
    extra_env = dict(item.split("=", 1) for item in args.env)
    run_dir = Path(tempfile.mkdtemp(prefix="mooncake-stall-"))
    options = SandboxOptions(replicas=2, keep_logs=True, run_dir=run_dir, speculative=not args.no_speculative)
    if args.no_warm_up:
        # Diagnostic: the first transfer after start-up is the one that stalled most often.
        async def skip(self: Sandbox, fresh: object) -> None:
            self.progress.phase("store path warm-up skipped (--no-warm-up)")

        Sandbox._warm_store_paths = skip  # type: ignore[method-assign]
    summary: list[dict[str, Any]] = []
    started = time.monotonic()
    async with start_sandbox(options, inherited_env={**os.environ, **extra_env}) as sandbox:
        print(
            json.dumps({"run_dir": str(run_dir), "startup_s": round(time.monotonic() - started, 1)}),
            flush=True,
        )
        loop_started = time.monotonic()
        async with httpx.AsyncClient() as client:
            for index in range(args.pairs):
                if time.monotonic() - loop_started > args.budget_s:
                    break
                writer, reader = (0, 1) if index % 2 == 0 else (1, 0)
                salt = f"stall-{index}-{uuid.uuid4().hex}"
                urls = sandbox.replica_urls
                cold, cold_s, cold_dumps = await timed_chat(
                    sandbox,
                    client,
                    urls[writer],
                    salt,
                    threshold_s=args.threshold_s,
                    label=f"pair{index}.cold",
                )
                warm, warm_s, warm_dumps = await timed_chat(
                    sandbox,
                    client,
                    urls[reader],
                    salt,
                    threshold_s=args.threshold_s,
                    label=f"pair{index}.warm",
                )
                row = {
                    "pair": index,
                    "at_s": round(time.monotonic() - started, 1),
                    "writer": sandbox.replicas[writer].name,
                    "reader": sandbox.replicas[reader].name,
                    "cold_s": round(cold_s, 2),
                    "cold_status": cold.status,
                    "warm_s": round(warm_s, 2),
                    "warm_status": warm.status,
                    "warm_cached": warm.cached_tokens,
                    "error": (cold.error or warm.error or "")[:300],
                    "dumps": cold_dumps + warm_dumps,
                }
                summary.append(row)
                print(json.dumps(row), flush=True)
    slow = [row for row in summary if max(row["cold_s"], row["warm_s"]) > args.threshold_s]
    failed = [row for row in summary if row["cold_status"] != 200 or row["warm_status"] != 200]
    print(
        json.dumps(
            {
                "pairs": len(summary),
                "slow": len(slow),
                "failed": len(failed),
                "warm_s_max": max((row["warm_s"] for row in summary), default=None),
                "env": extra_env,
                "run_dir": str(run_dir),
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting pairs after this long")
    parser.add_argument("--threshold-s", type=float, default=8.0, help="a request slower than this is dumped")
    parser.add_argument("--no-warm-up", action="store_true", help="skip the sandbox's store-path warm-up")
    parser.add_argument("--no-speculative", action="store_true")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for every process started")
    if not in_private_netns():
        sys.exit("run inside the loopback-only namespace: .venv/bin/python -m mooncake_operator.netns -- ...")
    sys.exit(asyncio.run(main(parser.parse_args())))
