"""The per-CPU stall watch: the sandbox reports stalls with it, and the e2e tiers rerun only after one."""

from __future__ import annotations

import os
import time

import pytest
from tests.support import cpu_stalls

from mooncake_operator.sandbox.cpu_stalls import CpuStall, CpuStallWatch


class JumpingClock:
    """time.monotonic, plus a jump we choose: what a watcher sees when its CPU did not run."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


def wait_for(predicate: object, timeout_s: float = 5.0) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_each_watcher_runs_pinned_to_its_own_cpu() -> None:
    watch = CpuStallWatch(tick_s=0.01)
    watch.start()
    try:
        cpus = sorted(os.sched_getaffinity(0))
        assert [thread.name for thread in watch._threads] == [f"cpu-stall-watch-{cpu}" for cpu in cpus]
        time.sleep(0.1)  # each thread pins itself first
        for cpu, thread in zip(cpus, watch._threads, strict=True):
            assert thread.native_id is not None
            assert os.sched_getaffinity(thread.native_id) == {cpu}
    finally:
        watch.stop()
    assert watch._threads == []


def test_a_wake_up_later_than_the_threshold_is_a_stall_and_a_shorter_one_is_not() -> None:
    clock = JumpingClock()
    watch = CpuStallWatch(threshold_s=5.0, tick_s=0.01, monotonic=clock)
    watch.start()
    try:
        time.sleep(0.1)
        clock.offset += 4.0  # late, but under the threshold: a busy CPU, not a stalled one
        time.sleep(0.1)
        assert watch.stalls_since() == []
        clock.offset += 6.0
        wait_for(lambda: len(watch.stalls_since()) == len(watch._threads))
    finally:
        watch.stop()
    stalls = watch.stalls_since()
    assert sorted(stall.cpu for stall in stalls) == sorted(os.sched_getaffinity(0))
    for stall in stalls:
        assert 5.9 < stall.late_s < 7.0
        assert stall.end - stall.start == pytest.approx(stall.late_s + 0.01, abs=0.05)
        assert f"CPU {stall.cpu} ran nothing for" in stall.describe()
    assert watch.stalls_since(time.time() + 1) == []


def test_a_failed_test_is_rerun_only_after_a_stall_that_ended_while_it_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    watch = CpuStallWatch()
    stall = CpuStall(cpu=0, start=100.0, end=160.0, late_s=59.9)
    watch._stalls.append(stall)
    monkeypatch.setattr(cpu_stalls, "_session_watch", watch)

    monkeypatch.setattr(cpu_stalls, "_test_started", 200.0)
    assert cpu_stalls.stalled_during_test(RuntimeError("HTTP 500")) is False

    monkeypatch.setattr(cpu_stalls, "_test_started", 150.0)  # the stall ended while this test ran
    assert cpu_stalls.stalled_during_test(RuntimeError("any failure")) is True
    assert cpu_stalls.stalls_during_test() == [stall]


def test_without_a_watch_nothing_is_rerun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_stalls, "_session_watch", None)
    assert cpu_stalls.stalled_during_test(None) is False
