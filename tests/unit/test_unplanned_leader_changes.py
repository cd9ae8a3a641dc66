"""The HA sandbox's steps across elections it did not cause: reported, and run again only when they did
not pass (`sandbox.ha.redo_after_unplanned_leader_changes`)."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest

from mooncake_sandbox.ha import (
    MAX_REDOS,
    LeaderChange,
    LeaderEpoch,
    MasterNode,
    UnplannedLeaderChange,
    redo_after_unplanned_leader_changes,
)
from mooncake_sandbox.progress import Progress

NODES = [MasterNode(index=i, rpc_port=50051 + i, metrics_port=9000 + i) for i in range(3)]


def epoch(leader: int, view: int) -> LeaderEpoch:
    node = NODES[leader]
    return LeaderEpoch(node.name, node.address, view, node=node)


class Script:
    """The epochs the masters report in turn, and the results the step gives in turn."""

    def __init__(self, epochs: list[LeaderEpoch], results: list[str | LeaderChange]) -> None:
        self._epochs: Iterator[LeaderEpoch] = iter(epochs)
        self._results = iter(results)
        self.attempts = 0
        self.store_waits = 0
        self.changes: list[LeaderChange] = []
        self.progress = io.StringIO()

    async def read_epoch(self) -> LeaderEpoch:
        return next(self._epochs)

    async def attempt(self) -> str:
        self.attempts += 1
        result = next(self._results)
        if isinstance(result, LeaderChange):
            raise UnplannedLeaderChange(result)
        return result

    async def store_serves(self) -> None:
        self.store_waits += 1

    async def run(self) -> str:
        return await redo_after_unplanned_leader_changes(
            "the canary",
            self.attempt,
            passed=lambda result: result == "Passed",
            read_epoch=self.read_epoch,
            store_serves=self.store_serves,
            changes=self.changes,
            progress=Progress(self.progress),
        )


async def test_a_passing_step_runs_once_even_across_an_election() -> None:
    script = Script([epoch(0, 3), epoch(1, 7)], ["Passed"])
    assert await script.run() == "Passed"
    assert (script.attempts, script.changes, script.store_waits) == (1, [], 0)


async def test_a_failing_step_without_an_election_is_not_run_again() -> None:
    """An Inconclusive canary with the same leader in the same view is the store's own result."""
    script = Script([epoch(0, 3), epoch(0, 3)], ["Inconclusive"])
    assert await script.run() == "Inconclusive"
    assert (script.attempts, script.changes, script.store_waits) == (1, [], 0)


async def test_a_failing_step_across_an_election_is_reported_and_run_again_once_the_store_serves() -> None:
    script = Script([epoch(0, 3), epoch(1, 7), epoch(1, 7)], ["Inconclusive", "Passed"])
    assert await script.run() == "Passed"
    assert script.attempts == 2 and script.store_waits == 1
    assert script.changes == [LeaderChange("the canary", epoch(0, 3), epoch(1, 7))]
    assert "unplanned leader change during the canary: master-0 (127.0.0.1:50051, view 3) -> master-1" in (
        script.progress.getvalue()
    )
    assert "redo 1 of 2" in script.progress.getvalue()


async def test_the_same_leader_re_elected_is_an_election_too() -> None:
    """A leader that lost its lease and won it back leads in a new view."""
    script = Script([epoch(0, 3), epoch(0, 5), epoch(0, 5)], ["Inconclusive", "Passed"])
    assert await script.run() == "Passed"
    assert len(script.changes) == 1


async def test_elections_every_attempt_stop_after_the_redos_and_the_last_result_stands() -> None:
    epochs = [epoch(i % 3, 10 * i) for i in range(2 * (MAX_REDOS + 1))]
    script = Script(epochs, ["Inconclusive"] * (MAX_REDOS + 1))
    assert await script.run() == "Inconclusive"
    assert script.attempts == MAX_REDOS + 1
    assert len(script.changes) == MAX_REDOS + 1  # every one reported, the last one too
    assert script.store_waits == MAX_REDOS


async def test_a_step_that_raises_an_unplanned_change_runs_again() -> None:
    change = LeaderChange("the failover proof, before the kill", epoch(0, 3), epoch(2, 6))
    script = Script([epoch(0, 3), epoch(2, 6)], [change, "Passed"])
    assert await script.run() == "Passed"
    assert script.changes == [change] and script.store_waits == 1


async def test_a_step_that_keeps_raising_raises_the_last_change() -> None:
    step = "the failover proof, after the kill"
    changes = [LeaderChange(step, epoch(1, i), epoch(2, i + 1)) for i in range(MAX_REDOS + 1)]
    script = Script([epoch(1, i) for i in range(MAX_REDOS + 1)], list(changes))
    with pytest.raises(UnplannedLeaderChange) as raised:
        await script.run()
    assert raised.value.change == changes[-1]
    assert script.changes == changes
    assert str(raised.value).startswith("unplanned leader change during the failover proof, after the kill")


def test_a_change_reports_both_epochs() -> None:
    change = LeaderChange("the canary", epoch(0, 3), epoch(1, 7))
    assert change.as_json() == {
        "during": "the canary",
        "before": {"leader": "master-0", "address": "127.0.0.1:50051", "view_version": 3},
        "after": {"leader": "master-1", "address": "127.0.0.1:50052", "view_version": 7},
        "summary": change.describe(),
    }
