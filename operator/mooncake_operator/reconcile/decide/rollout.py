"""An InPlace rollout that keeps serving (pure): which replica pods may be replaced now, decided from the
replica StatefulSet as found and the traffic the last pass wrote.

The StatefulSet's `RollingUpdate` replaces a pod once its ordinal is at or above the `partition`; below
it, pods keep their pod template. So the operator, not the StatefulSet controller, decides when an old
pod goes: a pod of the previous pod template is replaced only once it serves nobody. A serving one is
first taken out of the client Service (`retire`: its traffic label goes off in this pass), and the next
pass, which reads that from the status, lowers the partition below it. A serving pod is retired only
while every pod of the new template is proven (a canary covered it) and while at least
`replicas - maxUnavailable` proven pods keep serving without it. The first pods of a new template have
no partner of their template for the canary's pairs: `maxSurge` extra ordinals (started at the new
template, beside the old pods) and the retired old pods' replacements provide two at once; the canary
then proves every pod of the new template together (its ring), each time one more is replaced. Once
every ordinal below `spec.replicas` runs the new template and serves, the surge pods leave the Service
and then the StatefulSet shrinks back.

Without a proven old pod to protect (a first rollout, nothing serving) or with the canary off, the
StatefulSet rolls by itself (partition 0). `paused` holds the pods as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SlotPod:
    """A replica pod of the set, as the planner needs it."""

    ordinal: int
    name: str
    current: bool  # runs the pod template this pass renders
    serving: bool  # proven and in the client Service, as the last pass wrote it
    terminating: bool = False


@dataclass(frozen=True)
class InPlaceSettings:
    replicas: int  # spec.replicas
    max_unavailable: int
    max_surge: int
    paused: bool
    canary: bool  # spec.canary.enabled


@dataclass(frozen=True)
class LiveShape:
    """The StatefulSet as found: its replicas and partition (None: not set)."""

    replicas: int
    partition: int | None
    observed: bool = True  # its controller observed its generation: the pods' `current` can be trusted
    carries_template: bool = False  # the set as found already holds the pod template this pass renders


@dataclass(frozen=True)
class InPlaceStep:
    """What the replica StatefulSet is rendered with, and what this pass does to traffic."""

    replicas: int  # the StatefulSet's spec.replicas: spec.replicas, plus the surge during a rollout
    partition: int  # ordinals >= partition run the rendered pod template
    retire: tuple[str, ...] = ()  # serving pods that leave the client Service now: replaced next
    rolling: bool = False  # pods of a previous template remain (or surge pods are still up)
    message: str = ""  # what the rollout does or waits for; empty when nothing rolls

    @property
    def new_ordinals(self) -> range:
        """The ordinals that run (or are being replaced to run) the rendered template: what the canary
        proves."""
        return range(self.partition, self.replicas)


def plain(replicas: int) -> InPlaceStep:
    """The StatefulSet rolls by itself: every ordinal at the rendered template."""
    return InPlaceStep(replicas=replicas, partition=0)


def _names(pods: Sequence[SlotPod]) -> str:
    return ", ".join(pod.name for pod in sorted(pods, key=lambda pod: pod.ordinal))


def plan_in_place(settings: InPlaceSettings, live: LiveShape | None, pods: Sequence[SlotPod]) -> InPlaceStep:
    """The next step of an InPlace rollout (see the module's docstring)."""
    n = settings.replicas
    live_pods = [pod for pod in pods if not pod.terminating]
    old = [pod for pod in live_pods if not pod.current]
    surge_up = [pod for pod in pods if pod.ordinal >= n]
    if live is None:
        return plain(n)
    if settings.paused:
        if not old:
            return InPlaceStep(replicas=live.replicas, partition=live.partition or 0, rolling=bool(surge_up))
        top = max(pod.ordinal for pod in old) + 1
        current = len(live_pods) - len(old)
        message = (
            f"rollout paused (spec.rollout.paused): {current} of {len(live_pods)} replica pods run the new "
            f"pod template; waiting: {_names(old)}. Set spec.rollout.paused to false to go on"
        )
        # Never below the live partition: a pod the StatefulSet would replace now stays as it is.
        return InPlaceStep(
            replicas=live.replicas, partition=max(top, live.partition or 0), rolling=True, message=message
        )
    serving = [pod for pod in live_pods if pod.serving]
    if not settings.canary or not serving:
        return plain(n)  # nothing proven to protect, or no proof to wait for: the StatefulSet rolls
    if not live.observed and live.carries_template:
        # Right after an apply its controller has not caught up: no pod's template hash can be trusted
        # (each would read as old, and a steady set would grow a surge pod). The shape holds until it has.
        partition = live.partition or 0
        return InPlaceStep(
            replicas=live.replicas,
            partition=partition,
            rolling=live.replicas > n or partition > 0,
            message="rolling out in place: waiting for the StatefulSet controller to observe the pod template"
            if live.replicas > n or partition > 0
            else "",
        )
    if not old:
        return _finish(n, live, live_pods, surge_up)
    new = [pod for pod in live_pods if pod.current]
    unproven = [pod for pod in new if not pod.serving]
    # An old pod that serves nobody may go; one that serves stays until a pass retired it.
    keep = [pod for pod in old if pod.serving]
    budget = len(serving) - max(n - settings.max_unavailable, 0)
    retire: list[SlotPod] = []
    if not unproven and budget > 0 and live.observed:
        retire = sorted(keep, key=lambda pod: pod.ordinal, reverse=True)[:budget]
    kept = [pod for pod in keep if pod not in retire]
    partition = max((pod.ordinal + 1 for pod in kept + retire), default=0)
    replicas = n + settings.max_surge
    parts = [f"{len(new)} of {n} replica pods run the new pod template"]
    if unproven:
        parts.append(f"waiting for the canary to prove {_names(unproven)}")
    if retire:
        parts.append(f"taking {_names(retire)} out of the client Service, then replacing it")
    going = [pod for pod in old if not pod.serving]
    if going:
        parts.append(f"replacing {_names(going)}")
    parts.append(f"{len(serving) - len(retire)} proven replica pod(s) serve")
    return InPlaceStep(
        replicas=replicas,
        partition=partition,
        retire=tuple(pod.name for pod in retire),
        rolling=True,
        message="rolling out in place: " + "; ".join(parts),
    )


def _finish(
    n: int, live: LiveShape, live_pods: Sequence[SlotPod], surge_up: Sequence[SlotPod]
) -> InPlaceStep:
    """Every pod runs the rendered template: once every ordinal below spec.replicas serves, the surge
    pods leave the client Service, then the StatefulSet shrinks back."""
    if not surge_up:
        return plain(n)
    base = [pod for pod in live_pods if pod.ordinal < n]
    if len(base) < n or not all(pod.serving for pod in base):
        waiting = [pod for pod in base if not pod.serving]
        message = "rolling out in place: every replica pod runs the new pod template"
        if waiting:
            message += f"; waiting for the canary to prove {_names(waiting)}"
        return InPlaceStep(replicas=max(live.replicas, n), partition=0, rolling=True, message=message)
    serving_surge = [pod for pod in surge_up if pod.serving]
    if serving_surge:
        message = (
            f"rolling out in place: done; taking the surge pod(s) {_names(serving_surge)} out of the "
            "client Service, then removing them"
        )
        return InPlaceStep(
            replicas=live.replicas,
            partition=0,
            retire=tuple(pod.name for pod in serving_surge),
            rolling=True,
            message=message,
        )
    return plain(n)
