"""The per-CPU stall monitor that decides e2e reruns (tests/support/cpu_stalls.py)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from tests.support import cpu_stalls
from tests.support.cpu_stalls import CpuStallMonitor, Stall


def test_a_watcher_that_could_not_run_records_a_stall(tmp_path: Path) -> None:
    """SIGSTOP stands in for a CPU that runs nothing: the watcher wakes late and says by how much."""
    monitor = CpuStallMonitor(tmp_path / "stalls.jsonl", threshold_s=0.5)
    monitor.start()
    try:
        time.sleep(1.0)  # the watchers are running and pinned
        assert monitor.stalls_since(0) == []
        watcher = monitor._watchers[0]
        os.kill(watcher.pid, signal.SIGSTOP)
        time.sleep(1.5)
        os.kill(watcher.pid, signal.SIGCONT)
        deadline = time.monotonic() + 5
        while not monitor.stalls_since(0) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        monitor.stop()
    [stall] = monitor.stalls_since(0)
    assert stall.cpu == min(os.sched_getaffinity(0))
    assert 1.0 < stall.late_s < 3.0
    assert stall.end - stall.start == pytest.approx(stall.late_s + 0.1, abs=0.05)
    assert f"CPU {stall.cpu} ran nothing for" in stall.describe()


def test_only_stalls_that_ended_after_the_test_started_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "stalls.jsonl"
    old = {"cpu": 0, "start": 100.0, "end": 160.0, "late_s": 59.9}
    log.write_text(json.dumps(old) + "\n")
    monitor = CpuStallMonitor(log)
    monkeypatch.setattr(cpu_stalls, "_session_monitor", monitor)

    monkeypatch.setattr(cpu_stalls, "_test_started", 200.0)
    assert cpu_stalls.stalled_during_test(RuntimeError("HTTP 500")) is False

    monkeypatch.setattr(cpu_stalls, "_test_started", 150.0)  # the stall ended while this test ran
    assert cpu_stalls.stalled_during_test(RuntimeError("any failure")) is True
    assert cpu_stalls.stalls_during_test() == [Stall(**old)]


def test_without_a_monitor_nothing_is_rerun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_stalls, "_session_monitor", None)
    assert cpu_stalls.stalled_during_test(None) is False
