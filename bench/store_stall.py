"""Provoke and record the store-transfer stall: many warm loads against one running sandbox.

    flock /tmp/heavy.lock .venv/bin/python -m mooncake_sandbox.netns -- \
        .venv/bin/python bench/store_stall.py --pairs 40 --budget-s 420 [--no-warm-up] [--env GLOG_v=1]

Starts the sandbox once (master + 2 replicas), then runs cold-on-writer / warm-on-reader pairs with
fresh salts, alternating the direction. One JSON line per pair on stdout (with the UTC start of each
request, to line up with the engines' glog timestamps); a summary at the end. The run directory
(engine logs) is always kept. Diagnostic only: nothing here is judged.

Without stopping anything, a sampler thread reads every thread's CPU counters on the machine from /proc
twice a second and writes the busiest threads of each interval to threads.jsonl in the run directory:
what ran while a transfer stalled. `--py-spy` also dumps (`py-spy dump --native`) every replica process
when a request is still in flight after --threshold-s; that suspends the process it reads, and on a
starved machine the dump arrives late (docs/sandbox.md).
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
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from mooncake_operator.canary.client import chat
from mooncake_operator.canary.request import reference_request
from mooncake_sandbox import SandboxOptions, start_sandbox
from mooncake_sandbox.netns import in_private_netns
from mooncake_sandbox.processes import group_members
from mooncake_sandbox.runtime import Sandbox

REQUEST_TIMEOUT_S = 180.0
SAMPLE_INTERVAL_S = 0.5
SAMPLE_TOP = 12


def utc_now() -> str:
    return datetime.now(UTC).strftime("%H:%M:%S.%f")[:-3]


def thread_ticks() -> dict[tuple[int, int], tuple[str, str, int, int]]:
    """(pid, tid) -> (comm, state, last cpu, utime + stime ticks) for every thread on the machine."""
    found: dict[tuple[int, int], tuple[str, str, int, int]] = {}
    for stat in Path("/proc").glob("[0-9]*/task/[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # the thread exited meanwhile
        comm = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        # fields[0] is stat field 3 (state); utime, stime and processor are fields 14, 15 and 39.
        found[(int(stat.parts[2]), int(stat.parts[4]))] = (
            comm,
            fields[0],
            int(fields[36]),
            int(fields[11]) + int(fields[12]),
        )
    return found


def sample_threads(path: Path, stop: threading.Event) -> None:
    """Append the busiest threads of each interval (CPU ticks used, where they ran) to `path`."""
    previous = thread_ticks()
    with path.open("a") as out:
        while not stop.wait(SAMPLE_INTERVAL_S):
            current = thread_ticks()
            used = [
                (ticks - previous[key][3], key, comm, state, cpu)
                for key, (comm, state, cpu, ticks) in current.items()
                if key in previous and ticks > previous[key][3]
            ]
            used.sort(reverse=True)
            runnable = sum(1 for comm, state, cpu, ticks in current.values() if state == "R")
            busiest = [
                [pid, tid, comm, state, cpu, delta]
                for delta, (pid, tid), comm, state, cpu in used[:SAMPLE_TOP]
            ]
            out.write(json.dumps({"utc": utc_now(), "runnable": runnable, "busiest": busiest}) + "\n")
            out.flush()
            previous = current


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
    py_spy_dumps: bool,
) -> tuple[Any, float, int]:
    """One chat; with py_spy_dumps, dumps every replica process at threshold_s and every 20 s after."""
    started = time.monotonic()
    task = asyncio.ensure_future(
        chat(client, url, reference_request(), cache_salt=salt, timeout=REQUEST_TIMEOUT_S)
    )
    dumps = 0
    deadline = threshold_s
    while True:
        done, _ = await asyncio.wait({task}, timeout=max(0.0, started + deadline - time.monotonic()))
        if done:
            return task.result(), time.monotonic() - started, dumps
        sandbox.check_alive()
        if not py_spy_dumps:
            deadline += 20.0
            continue
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
    stop_sampling = threading.Event()
    sampler = threading.Thread(
        target=sample_threads, args=(run_dir / "threads.jsonl", stop_sampling), daemon=True
    )
    sampler.start()
    try:
        await run_pairs(args, options, extra_env, run_dir, summary, started)
    finally:
        stop_sampling.set()
        sampler.join()
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


async def run_pairs(
    args: argparse.Namespace,
    options: SandboxOptions,
    extra_env: dict[str, str],
    run_dir: Path,
    summary: list[dict[str, Any]],
    started: float,
) -> None:
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
                cold_utc = utc_now()
                cold, cold_s, cold_dumps = await timed_chat(
                    sandbox,
                    client,
                    urls[writer],
                    salt,
                    threshold_s=args.threshold_s,
                    label=f"pair{index}.cold",
                    py_spy_dumps=args.py_spy,
                )
                warm_utc = utc_now()
                warm, warm_s, warm_dumps = await timed_chat(
                    sandbox,
                    client,
                    urls[reader],
                    salt,
                    threshold_s=args.threshold_s,
                    label=f"pair{index}.warm",
                    py_spy_dumps=args.py_spy,
                )
                row = {
                    "pair": index,
                    "at_s": round(time.monotonic() - started, 1),
                    "writer": sandbox.replicas[writer].name,
                    "reader": sandbox.replicas[reader].name,
                    "cold_utc": cold_utc,
                    "warm_utc": warm_utc,
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting pairs after this long")
    parser.add_argument("--threshold-s", type=float, default=8.0, help="a request slower than this is slow")
    parser.add_argument("--py-spy", action="store_true", help="py-spy dump the replicas of a slow request")
    parser.add_argument("--no-warm-up", action="store_true", help="skip the sandbox's store-path warm-up")
    parser.add_argument("--no-speculative", action="store_true")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for every process started")
    if not in_private_netns():
        sys.exit("run inside the loopback-only namespace: .venv/bin/python -m mooncake_sandbox.netns -- ...")
    sys.exit(asyncio.run(main(parser.parse_args())))
