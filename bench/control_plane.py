"""Cluster-tier control plane: time to ready and to stop (etcd + kube-apiserver [+ controller-manager]).

Ready means: kube-apiserver's /readyz answers 200 and, with the controller-manager, the `default`
ServiceAccount exists (its first visible work). Run inside the loopback-only namespace as the tests
do, from the repository root:

    .venv/bin/python -m mooncake_sandbox.netns -- .venv/bin/python bench/control_plane.py [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.support

from tests.support.apiserver import start_control_plane


def measure(controller_manager: bool, runs: int) -> tuple[list[float], list[float]]:
    ready, stop = [], []
    for _ in range(runs):
        started = time.monotonic()
        plane = start_control_plane(controller_manager=controller_manager)
        ready.append(time.monotonic() - started)
        started = time.monotonic()
        plane.stop()
        stop.append(time.monotonic() - started)
    return ready, stop


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print("| components | runs | median ready | worst ready | median stop |")
    print("|---|---|---|---|---|")
    for controller_manager in (False, True):
        ready, stop = measure(controller_manager, args.runs)
        name = "etcd + apiserver" + (" + controller-manager" if controller_manager else "")
        print(
            f"| {name} | {args.runs} | {statistics.median(ready):.1f} s | {max(ready):.1f} s "
            f"| {statistics.median(stop):.1f} s |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
