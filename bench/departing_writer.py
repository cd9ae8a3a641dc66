"""What a reader gets from a replica that just left: its blocks, a failed load, or a clean miss.

    flock /tmp/heavy.lock .venv/bin/python bench/departing_writer.py [--shutdown-timeout S]

One sandbox (real mooncake_master, two real vLLM CPU replicas A and B on the patched engine, Eagle-3, the
operator's engine arguments). A answers the reference request under a fresh salt, so its blocks are in the
store; then A is stopped as the kubelet stops a pod: SIGTERM to its API server alone (the container's
PID 1), and it is left to exit by itself. Then B asks the same request under the same salt. Reported: how
long A took to exit, whether B answered, and what its counters say it loaded.

`--shutdown-timeout` replaces the operator's value for the run (build/engine_args.py): 0 is vLLM's default,
which aborts in-flight requests and force-kills the workers, so the store client never closes and the
master keeps A's blocks listed until its client TTL. Re-executes itself in a loopback-only network
namespace. JSON on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

import httpx

from mooncake_operator.build import engine_args
from mooncake_operator.canary.client import chat, scrape_counters
from mooncake_operator.canary.request import reference_request
from mooncake_sandbox import EngineMode, SandboxOptions, netns, prepare, start_sandbox

EXIT_WAIT_S = 60.0


async def measure() -> dict[str, Any]:
    prepared = prepare((EngineMode.PATCHED,), log=lambda line: print(line, file=sys.stderr))
    options = SandboxOptions(replicas=2, engine=EngineMode.PATCHED, speculative=True)
    async with (
        start_sandbox(options, prepared=prepared) as sandbox,
        httpx.AsyncClient(trust_env=False) as http,
    ):
        writer, reader = sandbox.replica_urls
        salt = f"departing-{uuid.uuid4().hex}"
        cold = await chat(http, writer, reference_request(), cache_salt=salt, timeout=300)
        assert cold.ok, cold.error
        await asyncio.sleep(3)  # the writer's puts land (bench/put_lag.py: milliseconds)
        process = sandbox.replicas[0].process
        assert process is not None
        started = time.monotonic()
        os.kill(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(process.popen.wait, EXIT_WAIT_S)
        exited_s = time.monotonic() - started
        log = process.log_path.read_text(errors="replace")
        sandbox.stop_replica(0)  # whatever is left of its group
        before = await scrape_counters(http, reader, timeout=30)
        warm = await chat(http, reader, reference_request(), cache_salt=salt, timeout=300)
        delta = (await scrape_counters(http, reader, timeout=30)).delta(before)
        return {
            "shutdown_timeout_s": engine_args.SHUTDOWN_TIMEOUT_SECONDS,
            "writer_exited_s": round(exited_s, 1),
            "writer_exited": process.exit_code() is not None,
            "writer_workers_force_killed": "force killing" in log,
            "reader_ok": warm.ok,
            "reader_error": warm.error,
            "reader_external_hit_tokens": delta.external_hit_tokens,
            "reader_store_keys": delta.store_keys_by_operation,
        }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=int,
        default=engine_args.SHUTDOWN_TIMEOUT_SECONDS,
        help="the engines' --shutdown-timeout (default: the operator's, %(default)s)",
    )
    args = parser.parse_args()
    if args.shutdown_timeout < 0:
        parser.error("--shutdown-timeout must be at least 0")
    if not netns.in_private_netns() and netns.namespaces_permitted():
        netns.exec_in_netns([sys.executable, *sys.argv])
    engine_args.SHUTDOWN_TIMEOUT_SECONDS = args.shutdown_timeout
    print(json.dumps(asyncio.run(measure()), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
