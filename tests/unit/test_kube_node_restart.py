"""The fault tier's restart helpers (tests/support/kube_node.py) on a plain process, and the audit-log
LIST count it measures relists with."""

from __future__ import annotations

import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from tests.support import kube_node


@pytest.fixture
def cluster_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(kube_node, "ROOT", tmp_path)
    monkeypatch.setattr(kube_node, "STATE", tmp_path / "state.json")
    return tmp_path


def started(cluster_root: Path, name: str, argv: list[str]) -> dict[str, Any]:
    workdir = cluster_root / "work"
    workdir.mkdir(exist_ok=True)
    state = kube_node.load_state()
    kube_node.spawn(state, name, argv, cwd=workdir)
    return running(name)


def running(name: str) -> dict[str, Any]:
    """The component's state entry, once /proc shows its command line (the exec completed), as a
    long-running component's would."""
    entry: dict[str, Any] = kube_node.load_state()["pids"][name]
    deadline = time.monotonic() + 5
    while not Path(f"/proc/{entry['pid']}/cmdline").read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    return entry


def test_restart_stops_the_recorded_pid_and_starts_the_same_command(cluster_root: Path) -> None:
    before = started(cluster_root, "sleeper", ["sleep", "300", "1"])
    probes: list[int] = []

    def healthy() -> bool:
        probes.append(1)
        return len(probes) >= 2

    try:
        kube_node.restart("sleeper", healthy, timeout=10)
        after = kube_node.load_state()["pids"]["sleeper"]
        assert after["pid"] != before["pid"]
        assert not kube_node._alive(before["pid"])
        assert kube_node.command_of(after["pid"]) == (["sleep", "300", "1"], cluster_root / "work")
        assert len(probes) >= 2  # it waited for healthy
    finally:
        pid = kube_node.load_state()["pids"]["sleeper"]["pid"]
        kube_node.stop_pid(pid, "sleep")


def test_restart_kills_a_component_that_outlives_its_grace(cluster_root: Path) -> None:
    # kube-apiserver drains its watches on SIGTERM for longer than the grace: the restart must still
    # find it gone (killed, and reaped: the session's components are the test process's children).
    ignores_term = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
    before = started(cluster_root, "stubborn", [sys.executable, "-c", ignores_term])
    try:
        kube_node.restart("stubborn", lambda: True, timeout=10, grace=0.5)
        assert not kube_node._alive(before["pid"])
    finally:
        after = running("stubborn")
        kube_node.stop_pid(after["pid"], after["exe"], grace=0.1)
        assert not kube_node._alive(after["pid"])


def test_restart_fails_when_the_component_never_becomes_healthy(cluster_root: Path) -> None:
    started(cluster_root, "sleeper", ["sleep", "300"])
    try:
        with pytest.raises(kube_node.ClusterError, match="sleeper healthy after its restart"):
            kube_node.restart("sleeper", lambda: False, timeout=1)
    finally:
        kube_node.stop_pid(kube_node.load_state()["pids"]["sleeper"]["pid"], "sleep")


def test_restart_refuses_a_component_that_is_not_running(cluster_root: Path) -> None:
    entry = started(cluster_root, "stopped", ["sleep", "300"])
    kube_node.stop_pid(entry["pid"], "sleep")
    with pytest.raises(kube_node.ClusterError, match="not running"):
        kube_node.restart("stopped", lambda: True)


def audit(user: str, verb: str, resource: str, at: str, group: str = "") -> str:
    ref = {"resource": resource, **({"apiGroup": group} if group else {})}
    event = {"verb": verb, "user": {"username": user}, "objectRef": ref, "requestReceivedTimestamp": at}
    return json.dumps(event)


def test_count_lists_counts_one_users_lists_per_resource_from_a_moment() -> None:
    operator = "system:serviceaccount:mooncake-system:mooncake-operator"
    lines = [
        audit(operator, "list", "pods", "2026-12-02T14:00:00.000000Z"),  # before
        audit(operator, "list", "pods", "2026-12-02T14:00:10.500000Z"),
        audit(operator, "list", "pods", "2026-12-02T14:00:11.000000Z"),
        audit(operator, "list", "mooncakeservings", "2026-12-02T14:00:12Z", "serving.mooncake-operator.dev"),
        audit(operator, "watch", "pods", "2026-12-02T14:00:12.000000Z"),
        audit("system:node:mooncake-node", "list", "pods", "2026-12-02T14:00:12.000000Z"),
        "",
    ]
    since = datetime(2026, 12, 2, 14, 0, 10, tzinfo=UTC)
    counts = kube_node.count_lists(lines, "system:serviceaccount:mooncake-system:", since)
    assert counts == {"pods": 2, "serving.mooncake-operator.dev/mooncakeservings": 1}
