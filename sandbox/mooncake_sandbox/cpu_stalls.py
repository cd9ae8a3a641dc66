"""Notice when the machine itself stops running one of its CPUs while the sandbox runs.

On the small VMs this project is tested on, a vCPU sometimes runs nothing at all for tens of seconds;
the kernel confirms it ("BUG: workqueue lockup - pool cpus=0 ... stuck for 56s!"). Whatever waits
on a process of that CPU then times out: a store transfer (HTTP 500 after 60 s), etcd's disk sync, a
master's lease. Such a run says something about the machine, not about the engines, so the sandbox
says so (docs/sandbox.md, "The cause"), and the e2e tests rerun a failed test only after one.

One daemon thread pinned to each CPU sleeps `tick_s` in a loop and records every wake-up more than
`threshold_s` late. Measured on these VMs: a pinned sleeper wakes 0.002-0.05 s late on an idle or
building machine and 1-4 s late several times a minute while the e2e engines run (often both CPUs at
once: short pauses of the whole VM, which a 60 s transfer timeout rides out); the failures were 31-56 s.
5 s is above every late wake-up seen outside a failure.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

THRESHOLD_S = 5.0
TICK_S = 0.1


@dataclass(frozen=True)
class CpuStall:
    cpu: int
    start: float  # wall clock (time.time())
    end: float
    late_s: float

    def describe(self) -> str:
        started = time.strftime("%H:%M:%S", time.gmtime(self.start))
        ended = time.strftime("%H:%M:%S", time.gmtime(self.end))
        return f"CPU {self.cpu} ran nothing for {self.late_s:.1f} s ({started}-{ended} UTC)"


class CpuStallWatch:
    """Start with `start()`, read with `stalls_since()`, end with `stop()` (the threads are daemons)."""

    def __init__(
        self,
        *,
        threshold_s: float = THRESHOLD_S,
        tick_s: float = TICK_S,
        cpus: Iterable[int] | None = None,  # default: every CPU this process may run on
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold_s = threshold_s
        self.tick_s = tick_s
        self.cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
        self._monotonic = monotonic
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._stalls: list[CpuStall] = []
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for cpu in self.cpus:
            thread = threading.Thread(
                target=self._watch, args=(cpu,), name=f"cpu-stall-watch-{cpu}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=2 * self.tick_s + 1)
        self._threads.clear()

    def stalls_since(self, since: float = 0.0) -> list[CpuStall]:
        """Stalls that ended at or after `since` (wall clock)."""
        with self._lock:
            return [stall for stall in self._stalls if stall.end >= since]

    def _watch(self, cpu: int) -> None:
        try:
            os.sched_setaffinity(0, {cpu})  # 0: this thread only (Linux)
        except OSError:
            return  # the CPU went away or is not ours: nothing to watch there
        last = self._monotonic()
        while not self._stopping.wait(self.tick_s):
            now = self._monotonic()
            late = now - last - self.tick_s
            if late > self.threshold_s:
                end = time.time()
                with self._lock:
                    self._stalls.append(CpuStall(cpu=cpu, start=end - (now - last), end=end, late_s=late))
            last = now
