"""Run the e2e tier N times in a row and count the reruns: the evidence that the tier needs none.

Issue 13 asks for the e2e tier to pass 10 runs in a row without a rerun. The tier still carries one
rule: a failed test runs again only when a CPU of this machine stalled while it ran
(tests/support/cpu_stalls.py). This driver runs the whole tier as CI does (in the loopback-only
namespace), reads pytest's summary line (passed, failed, errors, reruns), and watches the CPUs itself
with the sandbox's `CpuStallWatch`, so each run's record says whether the machine stalled and whether
any test needed the rule. One JSON line per run goes to stdout and, with --out, is appended to a file;
the last line is the summary: runs, clean runs, the longest streak of clean runs.

A run is clean when pytest exits 0 with no rerun. Each run takes the lock file given by --lock (the
team's machine lock), if any, so nothing heavy runs beside it.

    .venv/bin/python bench/e2e_streak.py --runs 10 --out bench/e2e_streak.jsonl --lock /tmp/heavy.lock
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mooncake_sandbox.cpu_stalls import CpuStallWatch

ROOT = Path(__file__).resolve().parents[1]
# pytest's last line, e.g. "15 passed, 1 rerun in 821.31s (0:13:41)" or "1 failed, 14 passed in ...".
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|rerun|skipped|xfailed|xpassed)")


@dataclass
class RunRecord:
    run: int
    started_utc: str
    wall_s: float
    exit_code: int
    counts: dict[str, int]
    rerun_tests: list[str]
    cpu_stalls: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return self.exit_code == 0 and self.counts.get("rerun", 0) == 0


def parse_summary(output: str) -> dict[str, int]:
    """The counts of pytest's final summary line ("error"/"errors" both count as "error")."""
    lines = [line for line in output.splitlines() if re.search(r" in \d+(\.\d+)?s", line)]
    if not lines:
        return {}
    counts: dict[str, int] = {}
    for number, word in _COUNT.findall(lines[-1]):
        key = "error" if word.startswith("error") else word
        counts[key] = counts.get(key, 0) + int(number)
    return counts


def rerun_tests(output: str) -> list[str]:
    """The tests pytest-rerunfailures lists under -rR ("RERUN tests/e2e/x.py::test_y")."""
    return sorted({line.split()[1] for line in output.splitlines() if line.startswith("RERUN ")})


@contextlib.contextmanager
def machine_lock(path: Path | None) -> Iterator[None]:
    if path is None:
        yield
        return
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_tier(
    run: int, python: str, lock: Path | None, pytest_args: list[str], log_dir: Path | None
) -> RunRecord:
    command = [python, "-m", "mooncake_sandbox.netns", "--", python, "-m", "pytest", "tests/e2e"]
    command += ["-q", "-rR", "-p", "no:cacheprovider", *pytest_args]
    watch = CpuStallWatch()
    with machine_lock(lock):
        watch.start()
        started = time.time()
        completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
        wall = time.time() - started
        watch.stop()
    output = completed.stdout + completed.stderr
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / f"run-{run}.log").write_text(output)
    return RunRecord(
        run=run,
        started_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        wall_s=round(wall, 1),
        exit_code=completed.returncode,
        counts=parse_summary(completed.stdout),  # pytest's own lines; the tests' stderr may say "in 3s"
        rerun_tests=rerun_tests(completed.stdout),
        cpu_stalls=[stall.describe() for stall in watch.stalls_since(started)],
    )


def longest_streak(records: list[RunRecord]) -> int:
    best = current = 0
    for record in records:
        current = current + 1 if record.clean else 0
        best = max(best, current)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="how many runs of the e2e tier (default 10)")
    parser.add_argument("--out", type=Path, help="append each run's JSON line to this file too")
    parser.add_argument("--lock", type=Path, help="hold this lock file (flock) during each run")
    parser.add_argument("--log-dir", type=Path, help="keep each run's pytest output here (run-N.log)")
    parser.add_argument("--python", default=sys.executable, help="the project's Python (default: this one)")
    parser.add_argument(
        "--stop-on-unclean", action="store_true", help="stop at the first run with a rerun or failure"
    )
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments, after --")
    args = parser.parse_args()
    # Started as a background job (`... &`), this process inherits SIGINT ignored, and so would the
    # tier's processes: its test of an interrupted sandbox would then fail for the driver's sake.
    # A Python handler here makes every child start with the default disposition.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    records: list[RunRecord] = []
    for run in range(1, args.runs + 1):
        record = run_tier(run, args.python, args.lock, args.pytest_args, args.log_dir)
        records.append(record)
        line = json.dumps({**asdict(record), "clean": record.clean})
        print(line, flush=True)
        if args.out is not None:
            with args.out.open("a") as out:
                out.write(line + "\n")
        if args.stop_on_unclean and not record.clean:
            break
    summary = {
        "runs": len(records),
        "clean_runs": sum(record.clean for record in records),
        "longest_clean_streak": longest_streak(records),
        "runs_with_a_cpu_stall": sum(bool(record.cpu_stalls) for record in records),
    }
    print(json.dumps({"summary": summary}), flush=True)
    if args.out is not None:
        with args.out.open("a") as out:
            out.write(json.dumps({"summary": summary}) + "\n")
    return 0 if summary["clean_runs"] == len(records) else 1


if __name__ == "__main__":
    sys.exit(main())
