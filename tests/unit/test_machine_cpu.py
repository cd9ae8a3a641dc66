"""The CI profiling plugin's reading of /proc/stat (tests/support/machine_cpu.py)."""

from __future__ import annotations

import pytest
from tests.support.machine_cpu import busy_seconds

pytestmark = pytest.mark.unit


def test_busy_time_is_every_field_but_idle_and_iowait() -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    text = "cpu  100 20 30 5000 400 6 7 8 50 0\ncpu0 50 10 15 2500 200 3 3 4 25 0\n"
    assert busy_seconds(text, 100.0) == pytest.approx((100 + 20 + 30 + 6 + 7 + 8) / 100)


def test_a_kernel_without_the_later_fields_still_counts() -> None:
    assert busy_seconds("cpu 10 0 10 1000\n", 10.0) == pytest.approx(2.0)


def test_anything_but_the_aggregate_line_is_refused() -> None:
    with pytest.raises(ValueError, match="aggregate"):
        busy_seconds("cpu0 1 2 3 4\n", 100.0)
