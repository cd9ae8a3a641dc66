"""bench/e2e_streak.py reads pytest's summary right: its counts are issue 13's evidence."""

from __future__ import annotations

import pytest
from bench.e2e_streak import RunRecord, longest_streak, parse_summary, rerun_tests

RUN_WITH_A_RERUN = """\
........RR.....F.                                                        [100%]
=========================== rerun test summary info ============================
RERUN tests/e2e/test_master_failover.py::test_a_leader_failover_keeps_the_prefixes_with_the_oplog
RERUN tests/e2e/test_master_failover.py::test_a_leader_failover_keeps_the_prefixes_with_the_oplog
platform stall during this failed test (rerun): CPU 0 ran nothing for 59.9 s (13:06:33-13:07:33 UTC)
1 failed, 14 passed, 2 rerun in 1105.21s (0:18:25)
"""


@pytest.mark.parametrize(
    ("output", "counts"),
    [
        (RUN_WITH_A_RERUN, {"failed": 1, "passed": 14, "rerun": 2}),
        ("...............  [100%]\n15 passed in 821.31s (0:13:41)\n", {"passed": 15}),
        ("==== 2 errors, 3 passed, 1 skipped in 9.00s ====\n", {"error": 2, "passed": 3, "skipped": 1}),
        ("INTERNALERROR> boom\n", {}),  # no summary line: nothing is counted, so the run is not clean
    ],
)
def test_the_summary_line_gives_the_counts(output: str, counts: dict[str, int]) -> None:
    assert parse_summary(output) == counts


def test_the_rerun_tests_are_listed_once() -> None:
    assert rerun_tests(RUN_WITH_A_RERUN) == [
        "tests/e2e/test_master_failover.py::test_a_leader_failover_keeps_the_prefixes_with_the_oplog"
    ]


def record(run: int, exit_code: int, **counts: int) -> RunRecord:
    return RunRecord(run, "2026-12-01T13:00:00Z", 800.0, exit_code, counts, [])


def test_a_run_is_clean_only_when_it_passed_without_a_rerun() -> None:
    assert record(1, 0, passed=15).clean
    assert not record(1, 0, passed=15, rerun=1).clean  # passed, but only after a rerun
    assert not record(1, 1, passed=14, failed=1).clean


def test_the_longest_streak_counts_clean_runs_in_a_row() -> None:
    runs = [record(1, 0, passed=15), record(2, 0, passed=15, rerun=1), record(3, 0, passed=15)]
    runs += [record(4, 0, passed=15), record(5, 1, failed=1)]
    assert longest_streak(runs) == 2
    assert longest_streak([]) == 0
