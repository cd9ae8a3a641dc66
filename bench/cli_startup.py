"""CPU time of `mooncake-operator` start-up, against `python -c pass` (the interpreter's own floor).

    .venv/bin/python bench/cli_startup.py [--runs 5]

With PYTHONPATH=<another checkout>/operator it measures that checkout's CLI (the "before" of a change).
Each command runs `--runs` times; the median user+system CPU seconds of the child is printed (CPU, not
wall: the shared machines are loaded). Results go in bench/RESULTS.md by hand.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "minimax-m2.5-eagle3.yaml"
CLI = [sys.executable, "-m", "mooncake_operator.cli"]

CASES: dict[str, list[str]] = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "--help": [*CLI, "--help"],
    "render --help": [*CLI, "render", "--help"],
    "crd --help": [*CLI, "crd", "--help"],
    "canary --help": [*CLI, "canary", "--help"],
    # The --replica path up to its first request: every import it needs, then a refused connection.
    "canary --replica (refused)": [
        *CLI,
        "canary",
        "--replica",
        "http://127.0.0.1:9",
        "--replica",
        "http://127.0.0.1:10",
        "--retries",
        "0",
    ],
    "render -f EXAMPLE": [*CLI, "render", "-f", str(EXAMPLE)],
    "crd": [*CLI, "crd"],
}


def cpu_seconds(command: list[str]) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, cwd=REPO)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(f"cpus: {os.cpu_count()}, runs: {args.runs}, python: {sys.version.split()[0]}")
    floor = None
    for name, command in CASES.items():
        median = statistics.median(cpu_seconds(command) for _ in range(args.runs))
        floor = median if floor is None else floor
        print(f"{name:<28} {median:6.3f} s CPU  (+{median - floor:.3f} over python -c pass)")


if __name__ == "__main__":
    main()
