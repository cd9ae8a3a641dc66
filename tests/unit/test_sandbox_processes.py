"""Process groups, teardown and ports of the sandbox's child processes (real processes, no engines)."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

from mooncake_sandbox.processes import (
    ManagedProcess,
    free_port,
    group_members,
    port_is_free,
    stop_processes,
    tree_rss_bytes,
)

pytestmark = pytest.mark.unit


def _start(tmp_path: Path, script: str, name: str = "child") -> ManagedProcess:
    return ManagedProcess.start(
        name, ["sh", "-c", script], env=dict(os.environ), log_path=tmp_path / f"{name}.log", cwd=tmp_path
    )


def _wait_for(predicate: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if callable(predicate) and predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


def test_stop_kills_the_whole_group_including_grandchildren(tmp_path: Path) -> None:
    process = _start(tmp_path, "sleep 300 & sleep 300 & wait")
    _wait_for(lambda: len(group_members(process.pgid)) >= 3)

    problems = stop_processes([process], grace_s=5)

    assert problems == []
    assert group_members(process.pgid) == []
    assert process.exit_code() is not None


def test_a_process_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    ignore_term = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ignoring', 'TERM', flush=True); time.sleep(300)"
    )
    process = _start(tmp_path, f'exec {sys.executable} -c "{ignore_term}"')
    _wait_for(lambda: "ignoring TERM" in process.log_path.read_text())
    started = time.monotonic()

    problems = stop_processes([process], grace_s=0.5)

    assert problems == []
    assert group_members(process.pgid) == []
    assert 0.5 <= time.monotonic() - started < 5


def test_each_process_leads_its_own_group(tmp_path: Path) -> None:
    first, second = _start(tmp_path, "sleep 300", "a"), _start(tmp_path, "sleep 300", "b")
    try:
        assert os.getpgid(first.pid) == first.pid
        assert os.getpgid(second.pid) == second.pid
        assert first.pgid != os.getpgrp()
    finally:
        stop_processes([first, second], grace_s=2)


def test_log_captures_output_and_the_command_line(tmp_path: Path) -> None:
    process = _start(tmp_path, "echo one; echo two >&2; exit 4")
    _wait_for(lambda: process.exit_code() is not None)

    tail = process.log_tail()

    assert process.exit_code() == 4
    assert tail.splitlines()[0].startswith("$ sh -c")
    assert "one" in tail and "two" in tail
    assert process.log_tail(lines=1) == "two"


def test_rss_sums_every_member_of_the_groups(tmp_path: Path) -> None:
    process = _start(tmp_path, "sleep 300 & sleep 300 & wait")
    try:
        _wait_for(lambda: len(group_members(process.pgid)) >= 3)
        assert tree_rss_bytes([process.pgid]) > 0
        assert tree_rss_bytes([]) == 0
    finally:
        stop_processes([process], grace_s=2)


def test_free_port_is_free_until_someone_listens() -> None:
    port = free_port()
    assert port_is_free(port)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        assert not port_is_free(port)
    assert port_is_free(port)
