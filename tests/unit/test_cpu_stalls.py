"""The per-CPU stall watch: the sandbox reports stalls with it, the e2e tiers rerun only after one, and
the cluster tier's waits leave stalls out of their deadlines."""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable

import pytest
from tests.cluster.operator_harness import eventually
from tests.support import cpu_stalls

from mooncake_sandbox.cpu_stalls import CpuStall, CpuStallWatch


class SteppingClock:
    """A monotonic clock that advances exactly one tick per reading, plus the jumps we queue: what a
    watcher sees when its CPU ran it on time, and when its CPU did not run for a while."""

    def __init__(self, tick_s: float) -> None:
        self.now = 0.0
        self.tick_s = tick_s
        self.jumps: list[float] = []

    def __call__(self) -> float:
        self.now += self.tick_s + (self.jumps.pop(0) if self.jumps else 0.0)
        return self.now


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
    cpu = min(os.sched_getaffinity(0))
    clock = SteppingClock(tick_s=0.01)
    clock.jumps = [0.0, 4.0, 0.0, 6.0]  # late by 4 s (a busy CPU, under the threshold), then by 6 s
    watch = CpuStallWatch(threshold_s=5.0, tick_s=0.01, cpus=[cpu], monotonic=clock)
    watch.start()
    try:
        wait_for(lambda: not clock.jumps and len(watch.stalls_since()) == 1)
    finally:
        watch.stop()
    [stall] = watch.stalls_since()
    assert stall.cpu == cpu
    assert stall.late_s == pytest.approx(6.0)
    assert stall.end - stall.start == pytest.approx(6.01)
    assert f"CPU {cpu} ran nothing for 6.0 s" in stall.describe()
    assert watch.stalls_since(time.time() + 1) == []


def test_a_failed_test_is_rerun_only_after_a_stall_that_ended_while_it_ran(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
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
    printed = capsys.readouterr().err
    assert "CPU 0 ran nothing for 59.9 s" in printed
    assert "failure before the rerun: RuntimeError: any failure" in printed
    # The plugin asks after a passing attempt too: the answer is the same, and nothing is printed.
    assert cpu_stalls.stalled_during_test(None) is True
    assert capsys.readouterr().err == ""


def test_without_a_watch_nothing_is_rerun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_stalls, "_session_watch", None)
    assert cpu_stalls.stalled_during_test(None) is False


def test_stalled_seconds_count_overlapping_stalls_once_and_only_after_the_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    watch = CpuStallWatch()
    watch._stalls += [
        CpuStall(cpu=0, start=90.0, end=110.0, late_s=20.0),  # began before the wait: 10 s inside it
        CpuStall(cpu=1, start=105.0, end=115.0, late_s=10.0),  # overlaps the first: 5 s more
        CpuStall(cpu=0, start=130.0, end=136.0, late_s=6.0),
        CpuStall(cpu=1, start=20.0, end=30.0, late_s=10.0),  # ended before the wait
    ]
    monkeypatch.setattr(cpu_stalls, "_session_watch", watch)
    assert cpu_stalls.stalled_seconds_since(100.0) == pytest.approx(10.0 + 5.0 + 6.0)
    assert cpu_stalls.stalled_seconds_since(200.0) == 0.0
    monkeypatch.setattr(cpu_stalls, "_session_watch", None)
    assert cpu_stalls.stalled_seconds_since(100.0) == 0.0


def ready_after(seconds: float) -> Callable[[], Awaitable[bool]]:
    """A probe that answers True from `seconds` after its first call on."""
    first: list[float] = []

    async def probe() -> bool:
        first.append(first[0] if first else time.monotonic())
        return time.monotonic() - first[0] >= seconds

    return probe


async def test_the_cluster_tiers_wait_leaves_a_stall_out_of_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Generous ratios: this runs beside the e2e tier in CI, where the process itself may pause.
    watch = CpuStallWatch()
    monkeypatch.setattr(cpu_stalls, "_session_watch", watch)
    with pytest.raises(AssertionError, match=r"timed out after 0.2s waiting for the probe; last: False"):
        await eventually(ready_after(30.0), within=0.2, what="the probe")

    # A 3 s stall recorded inside the wait: ready after 0.5 s, within 0.2 s of running time.
    now = time.time()
    watch._stalls.append(CpuStall(cpu=0, start=now, end=now + 3.0, late_s=3.0))
    assert await eventually(ready_after(0.5), within=0.2, what="the probe") is True

    now = time.time()
    watch._stalls[:] = [CpuStall(cpu=1, start=now, end=now + 1.0, late_s=1.0)]
    with pytest.raises(
        AssertionError, match=r"after 0.2s \(plus \d+\.\d s of CPU stalls\) waiting for the probe"
    ):
        await eventually(ready_after(30.0), within=0.2, what="the probe")
