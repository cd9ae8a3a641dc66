"""CI leaves the `slow` scenarios out on the promise that docs/testing.md lists each one with the tier that
proves it more cheaply and its run time: every slow test (a marked function, or a module marked whole) has
its row, and every row names a slow test that exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TESTING = REPO / "docs" / "testing.md"
SECTION = "## The slow scenarios"


def _marks_slow(node: ast.expr) -> bool:
    """`pytest.mark.slow`, alone or in a list (a module's `pytestmark`)."""
    if isinstance(node, ast.List | ast.Tuple):
        return any(_marks_slow(item) for item in node.elts)
    return isinstance(node, ast.Attribute) and node.attr == "slow"


def _is_slow_module_mark(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Assign)
        and any(isinstance(target, ast.Name) and target.id == "pytestmark" for target in node.targets)
        and _marks_slow(node.value)
    )


def _is_slow_test(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return node.name.startswith("test_") and any(_marks_slow(mark) for mark in node.decorator_list)


def slow_tests() -> dict[str, set[str]]:
    """Each test file with slow tests, and the slow tests' names ({"*"}: the whole module is slow)."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text(), str(path))
        relative = str(path.relative_to(REPO))
        for node in tree.body:
            if _is_slow_module_mark(node):
                found.setdefault(relative, set()).add("*")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _is_slow_test(node):
                found.setdefault(relative, set()).add(node.name)
    return found


def documented_rows() -> list[str]:
    """The first cell of each row of the slow scenarios' table: a file path or a test name, whose `…`
    stands for the rest of the name."""
    text = TESTING.read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", len(SECTION))]
    rows = re.findall(r"^\| `([^`]+)`", section, flags=re.MULTILINE)
    assert rows, f"{TESTING}: no table of slow scenarios under {SECTION!r}"
    return rows


def _covers(row: str, path: str, name: str) -> bool:
    if row.endswith(".py"):
        return row == path
    prefix = row.removesuffix("…")
    return name.startswith(prefix) if row.endswith("…") else name == prefix


def test_every_slow_scenario_has_its_row() -> None:
    rows = documented_rows()
    missing = [
        f"{path}::{name}"
        for path, names in slow_tests().items()
        for name in sorted(names)
        if not any(_covers(row, path, name) for row in rows)
    ]
    assert not missing, f"slow scenarios CI leaves out that {TESTING.name} does not list: {missing}"


def test_every_row_names_a_slow_scenario() -> None:
    tests = slow_tests()
    stale = [
        row
        for row in documented_rows()
        if not any(_covers(row, path, name) for path, names in tests.items() for name in names)
    ]
    assert not stale, f"{TESTING.name} lists slow scenarios that are not (or no longer) slow: {stale}"
