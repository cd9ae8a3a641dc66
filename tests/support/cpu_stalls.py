"""The e2e tiers' rerun rule: a failed test runs again only when a CPU of this machine stalled while it ran.

The watch is the sandbox's own (`mooncake_sandbox.cpu_stalls`: one pinned thread per CPU that
records wake-ups more than 5 s late), held for the whole test session. On 2026-12-01 every e2e failure
on the store transport fell inside such a stall, confirmed by the kernel ("BUG: workqueue lockup ...
stuck for 56s!"; docs/sandbox.md, "The cause"). A failure without one fails at once, HTTP 500 included.

Use: `pytest.mark.flaky(reruns=2, condition=stalled_during_test)` on the test, and the two fixtures
below in its module or conftest (imported: `cpu_stall_watch` is autouse). The cluster tier imports the
fixtures without the rerun: its waits leave the stalls out of their deadlines (`stalled_seconds_since`).
Run alone to watch a machine: `python tests/support/cpu_stalls.py [--threshold-s S]` (JSON lines).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict

import pytest

from mooncake_sandbox.cpu_stalls import CpuStall, CpuStallWatch

FAILURE_DETAIL_CHARS = 4000
_session_watch: CpuStallWatch | None = None
_test_started = 0.0


def stalls_during_test() -> list[CpuStall]:
    return _session_watch.stalls_since(_test_started) if _session_watch is not None else []


def stalled_seconds_since(since: float) -> float:
    """How long, since `since` (wall clock), some CPU of this machine ran nothing: the union of the
    recorded stalls clipped to it, 0 without a watch. A wait that counts only the machine's running time
    adds this to its deadline (the cluster tier's `eventually`): a stall pauses the process it waits
    for, so the time it lasted says nothing of that process."""
    if _session_watch is None:
        return 0.0
    total, covered_until = 0.0, since
    for stall in sorted(_session_watch.stalls_since(since), key=lambda stall: stall.start):
        start = max(stall.start, covered_until)
        if stall.end > start:
            total += stall.end - start
            covered_until = stall.end
    return total


def stalled_during_test(error: BaseException | None = None) -> bool:
    """pytest-rerunfailures' `condition`: rerun a failed test only when a CPU stalled while it ran.

    The plugin also asks after a passing attempt (with no error); only a failure's answer is printed,
    with the failure itself (the plugin keeps no record of a rerun attempt's failure).
    """
    stalls = stalls_during_test()
    if error is not None:
        for stall in stalls:
            print(f"platform stall during this failed test (rerun): {stall.describe()}", file=sys.stderr)
        if stalls:
            detail = str(error)[:FAILURE_DETAIL_CHARS]
            print(f"failure before the rerun: {type(error).__name__}: {detail}", file=sys.stderr)
    return bool(stalls)


@pytest.fixture(scope="session")
def cpu_stall_monitor() -> Iterator[CpuStallWatch]:
    """The session's per-CPU watch."""
    global _session_watch
    watch = CpuStallWatch()
    watch.start()
    _session_watch = watch
    yield watch
    watch.stop()
    _session_watch = None


@pytest.fixture(autouse=True)
def cpu_stall_watch(cpu_stall_monitor: CpuStallWatch) -> Iterator[None]:
    """Autouse where imported: marks when each test (attempt) starts; prints the stalls it saw."""
    global _test_started
    _test_started = time.time()
    yield
    for stall in stalls_during_test():
        print(f"platform stall during this test: {stall.describe()}")


def main() -> int:
    parser = argparse.ArgumentParser(description="Print every CPU stall of this machine as a JSON line.")
    parser.add_argument("--threshold-s", type=float, default=5.0)
    args = parser.parse_args()
    watch = CpuStallWatch(threshold_s=args.threshold_s)
    watch.start()
    seen = 0
    try:
        while True:
            time.sleep(1)
            stalls = watch.stalls_since()
            for stall in stalls[seen:]:
                print(json.dumps(asdict(stall)), flush=True)
            seen = len(stalls)
    except KeyboardInterrupt:
        return 0
    finally:
        watch.stop()


if __name__ == "__main__":
    sys.exit(main())
