"""Which tests cost CI its time: the whole machine's CPU seconds per test, as a pytest plugin.

CI's machine is CPU-bound (2 cores, idle under 10% through set-up and the tiers: bench/RESULTS.md, "CI's
budget"), so only work removed shortens it, and a test's wall time hides the work its subprocesses do
(vLLM engines, kube-apiserver, builds). This reads the machine's busy time from /proc/stat around each
test's setup, call and teardown, and prints the costliest at the end. Machine-wide: meaningful when the
session runs alone on the machine.

    python -m pytest -p tests.support.machine_cpu tests/e2e          # top 25
    MACHINE_CPU_TOP=50 python -m pytest -p tests.support.machine_cpu tests/unit
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator
from pathlib import Path

import pytest

# /proc/stat's first line: cpu user nice system idle iowait irq softirq steal guest guest_nice (jiffies).
# Busy is everything but idle and iowait; guest time is already inside user.
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def busy_seconds(stat_text: str, ticks_per_second: float) -> float:
    """The machine's busy CPU seconds since boot, all cores summed, from /proc/stat's text."""
    first = stat_text.split("\n", 1)[0].split()
    if not first or first[0] != "cpu":
        raise ValueError(f"not /proc/stat's aggregate line: {first[:3]}")
    values = [int(value) for value in first[1:]]
    return sum(values[index] for index in _BUSY_FIELDS if index < len(values)) / ticks_per_second


def _now() -> tuple[float, float]:
    text = Path("/proc/stat").read_text()
    return time.monotonic(), busy_seconds(text, os.sysconf("SC_CLK_TCK"))


_costs: dict[str, tuple[float, float]] = {}  # test id -> (machine CPU seconds, wall seconds)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    wall, busy = _now()
    yield
    wall_after, busy_after = _now()
    _costs[item.nodeid] = (busy_after - busy, wall_after - wall)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _costs:
        return
    top = int(os.environ.get("MACHINE_CPU_TOP", "25"))
    total_cpu = sum(cpu for cpu, _ in _costs.values())
    total_wall = sum(wall for _, wall in _costs.values())
    terminalreporter.section(
        f"machine CPU per test (all cores; {total_cpu:.0f} CPU s over {total_wall:.0f} s of tests)"
    )
    ranked = sorted(_costs.items(), key=lambda item: item[1][0], reverse=True)[:top]
    for nodeid, (cpu, wall) in ranked:
        terminalreporter.write_line(f"{cpu:8.1f} CPU s {wall:8.1f} s  {nodeid}")
