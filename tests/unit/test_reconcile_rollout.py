"""The InPlace rollout's planner (`reconcile.decide.rollout.plan_in_place`): a table of states -> steps,
then whole rollouts simulated against a model of the StatefulSet controller and the canary, checking at
every pass that at least replicas - maxUnavailable proven pods serve, that no pod is replaced while it
serves, that no old pod leaves while a new one is unproven, and that the rollout ends at spec.replicas."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from mooncake_operator.reconcile.decide.rollout import (
    InPlaceSettings,
    InPlaceStep,
    LiveShape,
    SlotPod,
    plan_in_place,
)

pytestmark = pytest.mark.unit

SET = "demo-replica"


def settings(
    replicas: int = 2, unavailable: int = 1, surge: int = 1, *, paused: bool = False, canary: bool = True
) -> InPlaceSettings:
    return InPlaceSettings(replicas, unavailable, surge, paused, canary)


def pod(ordinal: int, *, current: bool, serving: bool) -> SlotPod:
    return SlotPod(ordinal, f"{SET}-{ordinal}", current, serving)


OLD, NEW, NEW_UNPROVEN, RETIRED = (
    {"current": False, "serving": True},
    {"current": True, "serving": True},
    {"current": True, "serving": False},
    {"current": False, "serving": False},
)


def pods(*states: dict[str, bool]) -> list[SlotPod]:
    return [pod(ordinal, **state) for ordinal, state in enumerate(states)]


CASES = [
    # (what, settings, live shape, pods, expected step's replicas, partition, retire, rolling)
    ("no set yet: created whole", settings(), None, [], 2, 0, (), False),
    ("steady: nothing rolls", settings(), LiveShape(2, 0), pods(NEW, NEW), 2, 0, (), False),
    (
        "a new template: one surge pod, the highest old pod leaves the Service first",
        settings(),
        LiveShape(2, 0),
        pods(OLD, OLD),
        3,
        2,
        (f"{SET}-1",),
        True,
    ),
    (
        "the retired pod is out: the partition goes below it",
        settings(),
        LiveShape(3, 2),
        pods(OLD, RETIRED),
        3,
        1,
        (),
        True,
    ),
    (
        "two new pods unproven: nothing more leaves until the canary proved them",
        settings(),
        LiveShape(3, 1),
        pods(OLD, NEW_UNPROVEN, NEW_UNPROVEN),
        3,
        1,
        (),
        True,
    ),
    (
        "the new pods proven: the next old pod leaves",
        settings(),
        LiveShape(3, 1),
        pods(OLD, NEW, NEW),
        3,
        1,
        (f"{SET}-0",),
        True,
    ),
    (
        "the last old pod is out: replaced",
        settings(),
        LiveShape(3, 1),
        pods(RETIRED, NEW, NEW),
        3,
        0,
        (),
        True,
    ),
    (
        "every pod new, one unproven: the surge stays",
        settings(),
        LiveShape(3, 0),
        pods(NEW_UNPROVEN, NEW, NEW),
        3,
        0,
        (),
        True,
    ),
    (
        "every pod new and proven: the surge pod leaves the Service first",
        settings(),
        LiveShape(3, 0),
        pods(NEW, NEW, NEW),
        3,
        0,
        (f"{SET}-2",),
        True,
    ),
    (
        "the surge pod is out: the set shrinks back",
        settings(),
        LiveShape(3, 0),
        pods(NEW, NEW, NEW_UNPROVEN),
        2,
        0,
        (),
        False,
    ),
    (
        "paused before it started: no pod changes",
        settings(paused=True),
        LiveShape(2, 0),
        pods(OLD, OLD),
        2,
        2,
        (),
        True,
    ),
    (
        "paused midway: the partition stays above every old pod",
        settings(paused=True),
        LiveShape(3, 1),
        pods(OLD, NEW, NEW),
        3,
        1,
        (),
        True,
    ),
    ("paused, nothing to roll", settings(paused=True), LiveShape(2, 0), pods(NEW, NEW), 2, 0, (), False),
    (
        "canary off: the StatefulSet rolls by itself",
        settings(canary=False),
        LiveShape(2, 0),
        pods(OLD, OLD),
        2,
        0,
        (),
        False,
    ),
    (
        "nothing proven serves: nothing to protect",
        settings(),
        LiveShape(2, 0),
        pods(RETIRED, RETIRED),
        2,
        0,
        (),
        False,
    ),
    (
        "no surge, maxUnavailable 2: two old pods leave at once (they pair)",
        settings(4, unavailable=2, surge=0),
        LiveShape(4, 0),
        pods(OLD, OLD, OLD, OLD),
        4,
        4,
        (f"{SET}-3", f"{SET}-2"),
        True,
    ),
    (
        "maxUnavailable 0: two surge pods pair before any old pod leaves",
        settings(2, unavailable=0, surge=2),
        LiveShape(2, 0),
        pods(OLD, OLD),
        4,
        2,
        (),
        True,
    ),
]


@pytest.mark.parametrize(
    ("what", "given", "live", "found", "replicas", "partition", "retire", "rolling"),
    CASES,
    ids=[case[0] for case in CASES],
)
def test_rollout_planner_table(
    what: str,
    given: InPlaceSettings,
    live: LiveShape | None,
    found: list[SlotPod],
    replicas: int,
    partition: int,
    retire: tuple[str, ...],
    rolling: bool,
) -> None:
    step = plan_in_place(given, live, found)
    assert (step.replicas, step.partition, step.retire, step.rolling) == (
        replicas,
        partition,
        retire,
        rolling,
    )


def test_the_controller_not_caught_up_retires_nothing() -> None:
    """Right after an apply the pods' template hash cannot be trusted: no old pod leaves."""
    step = plan_in_place(settings(), LiveShape(3, 1, observed=False), pods(OLD, NEW, NEW))
    assert step.retire == () and step.partition == 1


@pytest.mark.parametrize("partition", [None, 0])
def test_a_steady_set_its_controller_has_not_caught_up_with_grows_no_surge_pod(partition: int | None) -> None:
    """The set already carries the rendered template, its controller has not observed the last apply
    yet: every pod's hash reads as old, but nothing rolls: the shape holds, no surge pod, nobody retired."""
    live = LiveShape(2, partition, observed=False, carries_template=True)
    step = plan_in_place(settings(), live, pods(OLD, OLD))
    assert (step.replicas, step.partition, step.retire, step.rolling) == (2, 0, (), False)


def test_a_rolling_set_its_controller_has_not_caught_up_with_holds_its_shape() -> None:
    live = LiveShape(3, 1, observed=False, carries_template=True)
    step = plan_in_place(settings(), live, pods(OLD, OLD, OLD))
    assert (step.replicas, step.partition, step.retire, step.rolling) == (3, 1, (), True)
    assert "waiting for the StatefulSet controller" in step.message


def test_a_new_template_on_a_set_not_caught_up_protects_every_serving_pod() -> None:
    """A new template arrives while the controller lags: no serving pod is replaced."""
    live = LiveShape(2, 0, observed=False, carries_template=False)
    step = plan_in_place(settings(), live, pods(OLD, OLD))
    assert step.retire == () and step.partition == 2


def test_the_status_message_says_what_waits() -> None:
    paused = plan_in_place(settings(paused=True), LiveShape(2, 0), pods(OLD, OLD))
    assert "rollout paused" in paused.message and f"{SET}-0, {SET}-1" in paused.message
    waiting = plan_in_place(settings(), LiveShape(3, 1), pods(OLD, NEW_UNPROVEN, NEW_UNPROVEN))
    assert f"waiting for the canary to prove {SET}-1, {SET}-2" in waiting.message
    assert "1 proven replica pod(s) serve" in waiting.message


@dataclass
class Slot:
    current: bool
    serving: bool
    uid: int = 0


def simulate(given: InPlaceSettings, passes: int = 60) -> list[int]:
    """A whole rollout from `replicas` old serving pods: each pass plans a step, writes the traffic
    (`retire` off), then the StatefulSet controller acts on replicas and partition (replacing every
    ordinal at or above the partition that runs another template), then a canary proves the step's new
    pods once at least two of them run, when they are not the pods the last run proved (its target,
    by pod instance). Returns the number of serving pods after each pass."""
    n = given.replicas
    slots = {ordinal: Slot(current=False, serving=True) for ordinal in range(n)}
    shape = LiveShape(n, 0)
    served = []
    uids = iter(range(1, 10_000))
    last_target: set[tuple[int, int]] = set()
    for _ in range(passes):
        found = [pod(o, current=s.current, serving=s.serving) for o, s in sorted(slots.items())]
        step: InPlaceStep = plan_in_place(given, shape, found)
        unproven = [o for o, s in slots.items() if s.current and not s.serving]
        for name in step.retire:
            ordinal = int(name.rsplit("-", 1)[1])
            assert not (unproven and not slots[ordinal].current), "an old pod left before the new were proven"
            slots[ordinal].serving = False
        for ordinal in [o for o in slots if o >= step.replicas]:
            assert not slots[ordinal].serving, f"pod {ordinal} removed while serving"
            del slots[ordinal]
        for ordinal in range(step.replicas):
            if ordinal not in slots:
                slots[ordinal] = Slot(current=ordinal >= step.partition, serving=False, uid=next(uids))
            elif ordinal >= step.partition and not slots[ordinal].current:
                assert not slots[ordinal].serving, f"pod {ordinal} replaced while serving"
                slots[ordinal] = Slot(current=True, serving=False, uid=next(uids))
        shape = LiveShape(step.replicas, step.partition)
        assert len(slots) <= n + given.max_surge
        new = [o for o in step.new_ordinals if o in slots and slots[o].current]
        target = {(o, slots[o].uid) for o in new}
        if len(new) >= 2 and len(new) == len(step.new_ordinals) and target != last_target:
            last_target = target
            for ordinal in new:
                slots[ordinal].serving = True
        serving = sum(1 for s in slots.values() if s.serving)
        served.append(serving)
        assert serving >= n - given.max_unavailable, f"only {serving} serving after {step}"
        if not step.rolling and all(s.current and s.serving for s in slots.values()) and len(slots) == n:
            return served
    raise AssertionError(f"no end after {passes} passes: {slots}")


@pytest.mark.parametrize(
    ("replicas", "unavailable", "surge"),
    [(2, 1, 1), (3, 1, 1), (4, 1, 1), (4, 2, 0), (2, 0, 2), (5, 2, 1), (2, 2, 0), (8, 1, 1)],
)
def test_a_whole_rollout_keeps_serving(replicas: int, unavailable: int, surge: int) -> None:
    served = simulate(settings(replicas, unavailable, surge))
    assert min(served) >= replicas - unavailable
    assert served[-1] == replicas


def test_two_replicas_by_default_never_serve_fewer_than_one() -> None:
    served = simulate(settings())
    assert min(served) == 1


def test_removing_the_surge_pod_needs_no_new_canary_run() -> None:
    """The pods left after the surge goes were all proven by the last passing run; a failed or
    inconclusive run, or a pod not in it, still makes the canary due."""
    from datetime import UTC, datetime

    from mooncake_operator.api.status import CanaryStatus
    from mooncake_operator.reconcile.decide.schedule import canary_due, current_target

    def target(*pods: str):  # type: ignore[no-untyped-def]
        return current_target(
            revision="r",
            generation=1,
            replica_pods=list(pods),
            master_pod=None,
            master_restarts=0,
            rerun=None,
        )

    now = datetime(2026, 12, 1, tzinfo=UTC)

    def last(verdict: str, *pods: str) -> CanaryStatus:
        return CanaryStatus(
            run_id="x", verdict=verdict, reason="", finished_at="2026-12-01T00:00:00Z", target=target(*pods)
        )

    def due(before: CanaryStatus, *pods: str) -> str | None:
        return canary_due(
            before, target(*pods), now=now, interval_seconds=None, inconclusive_retry_seconds=60
        )

    three = ("a-0=u0", "a-1=u1", "a-2=u2")
    assert due(last("Passed", *three), "a-0=u0", "a-1=u1") is None
    assert due(last("Failed", *three), "a-0=u0", "a-1=u1") is not None
    assert due(last("Passed", *three), "a-0=u0", "a-1=u9") is not None
