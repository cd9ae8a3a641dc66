"""The fault tier's revision rollouts (scenario 8): who the client Service routed users to while a new
model revision rolled out, sampled, and what each `spec.rollout.strategy` promises about it
(docs/operator.md, "Rollout strategies"): `InPlace` may leave nobody serving between the last old pod's
replacement and the new revision's pass, and users fail only then; `BlueGreen` keeps the old set serving
at full size until the candidate passed, never an empty client Service, then the old set leaves."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tests.support import cluster
from tests.support.fault_load import OVERLOADED, Response, replica_pods
from tests.support.fault_scenarios import client_endpoints, proven_again_after, status_of
from tests.support.kube_node import kubectl

from mooncake_operator.build.names import COMPONENT_REPLICA, ENGINE_CONTAINER, LABEL_COMPONENT, LABEL_INSTANCE
from mooncake_operator.reconcile.decide.observe import in_set


@dataclass(frozen=True)
class TrafficSample:
    """One look at the client Service: the replica pods' IPs (read first), its ready addresses, then
    the rollout status (read last: a switch it does not show yet had not begun when the addresses were
    read)."""

    at: float  # time.monotonic() just before the addresses were read
    pods: dict[str, str]  # replica pod name -> pod IP
    endpoints: frozenset[str]
    serving_set: str | None  # status.rollout.servingSet
    candidate_set: str | None  # status.rollout.candidateSet


def sample_traffic(name: str) -> TrafficSample:
    pods = {p["metadata"]["name"]: p["status"].get("podIP") or "" for p in replica_pods(name)}
    at = time.monotonic()
    endpoints = frozenset(client_endpoints(name))
    rollout = status_of(name).get("rollout") or {}
    return TrafficSample(at, pods, endpoints, rollout.get("servingSet"), rollout.get("candidateSet"))


SAMPLE_EVERY_S = 0.5


class TrafficSampler:
    """Samples who the client Service routes to on a thread (`sample_traffic`), also while the fault's
    injection blocks, until closed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.samples: list[TrafficSample] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traffic-sampler", daemon=True)

    def __enter__(self) -> TrafficSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            try:
                self.samples.append(sample_traffic(self.name))
            except Exception as error:  # a failed read is a gap in the samples, reported, not the end
                self.errors.append(repr(error))


def unserved_windows(samples: Sequence[TrafficSample], settle_s: float) -> list[tuple[float, float]]:
    """When the client Service may have had no ready address: each run of samples without one, widened
    to the last sample before it that had one and to the first after it that had one plus `settle_s`
    (kube-proxy follows the EndpointSlices within that). A run at either end is open on that side."""
    windows: list[tuple[float, float]] = []
    last_served = float("-inf")
    run_start: float | None = None  # set while in a run of samples without a ready address
    for sample in samples:
        if not sample.endpoints:
            if run_start is None:
                run_start = last_served
            continue
        if run_start is not None:
            windows.append((run_start, sample.at + settle_s))
            run_start = None
        last_served = sample.at
    if run_start is not None:
        windows.append((run_start, float("inf")))
    return windows


def unserved_seconds(samples: Sequence[TrafficSample]) -> float:
    """How long the samples saw the client Service without a ready address: from the first sample of each
    such run to the next sample with one (or the last sample)."""
    total, since = 0.0, None
    for sample in samples:
        if not sample.endpoints and since is None:
            since = sample.at
        elif sample.endpoints and since is not None:
            total, since = total + sample.at - since, None
    if since is not None:
        total += samples[-1].at - since
    return total


def errors_outside(responses: Sequence[Response], windows: Sequence[tuple[float, float]]) -> list[Response]:
    """Requests that failed (not 200; the load's own `overloaded` ticks, saturation, aside) and started
    outside every window."""
    return [
        r
        for r in responses
        if r.status not in (200, OVERLOADED) and not any(low <= r.started <= high for low, high in windows)
    ]


def bluegreen_violations(samples: Sequence[TrafficSample], old_set: str, desired: int) -> list[str]:
    """What BlueGreen promises about the client Service, checked on every sample: never empty; until the
    switch (the status still names `old_set` serving) exactly the old set's `desired` pods, none of the
    candidate's; and a candidate set was seen at all (else the rollout was not BlueGreen)."""
    problems = []
    for sample in samples:
        if not sample.endpoints:
            problems.append(f"at {sample.at:.1f}: the client Service had no ready address")
        if sample.serving_set is None:
            problems.append(f"at {sample.at:.1f}: status.rollout.servingSet unset")
        elif sample.serving_set == old_set:
            old = {ip for pod, ip in sample.pods.items() if in_set(pod, old_set)}
            if sample.endpoints != old or len(old) != desired:
                problems.append(
                    f"at {sample.at:.1f}, before the switch: the client Service routed to "
                    f"{sorted(sample.endpoints)}, not the old set's {desired} pods {sorted(old)} "
                    f"(pods: {sample.pods})"
                )
    if not any(s.candidate_set for s in samples):
        problems.append("no candidate set was ever seen in status.rollout")
    return problems


def runs_model(pod: dict[str, Any], model: str) -> bool:
    """The pod's engine container serves `model` (vllm serve's positional argument, or --model)."""
    (engine,) = [c for c in pod["spec"]["containers"] if c["name"] == ENGINE_CONTAINER]
    return model in [*(engine.get("command") or []), *(engine.get("args") or [])]


def serving_pods(name: str) -> list[dict[str, Any]]:
    """The live, non-terminating pods of the replica set the status names serving."""
    serving_set = (status_of(name).get("rollout") or {}).get("servingSet")
    return [
        p
        for p in replica_pods(name)
        if serving_set is not None
        and in_set(p["metadata"]["name"], serving_set)
        and not p["metadata"].get("deletionTimestamp")
    ]


def rolled_out_after(name: str, moment: float, model: str, revision_before: str) -> Callable[[], bool]:
    """`proven_again_after`, and the proof is the new revision's: the status describes the changed spec
    (observedGeneration), the spec revision moved, the canary ran at it (`target.revision` is the desired
    and the serving revision) over every pod of the serving set as it is now (and perhaps the InPlace
    surge pod, gone since), every one of which serves `model`."""
    proven = proven_again_after(name, moment)

    def probe() -> bool:
        if not proven():
            return False
        serving = cluster.get_serving(name)
        status = serving.get("status") or {}
        target = (status.get("canary") or {}).get("target") or {}
        pods = serving_pods(name)
        identities = {f"{p['metadata']['name']}={p['metadata']['uid']}" for p in pods}
        return (
            status.get("observedGeneration") == serving["metadata"]["generation"]
            and status.get("desiredRevision") not in (None, revision_before)
            and target.get("revision") == status["desiredRevision"] == status.get("servingRevision")
            # Every serving pod as it is now was covered; an InPlace canary may also have covered the
            # surge pod, which leaves once the set is proven at its size.
            and identities <= {entry.split("#")[0] for entry in target.get("replicaPods") or []}
            and len(pods) == serving["spec"]["replicas"]
            and all(runs_model(p, model) for p in pods)
        )

    return probe


def roll_out(name: str, model: str, strategy: str) -> None:
    """What a user does: one merge patch of the model and the rollout strategy."""
    patch = {"spec": {"model": {"name": model}, "rollout": {"strategy": strategy}}}
    kubectl(["patch", "mcs", name, "--namespace=default", "--type=merge", f"--patch={json.dumps(patch)}"])


def replica_sets(name: str) -> list[str]:
    """The resource's replica StatefulSets (NAME-replica, BlueGreen's NAME-r<hex>)."""
    selector = f"{LABEL_INSTANCE}={name},{LABEL_COMPONENT}={COMPONENT_REPLICA}"
    listing = json.loads(
        kubectl(["get", "statefulsets", "--namespace=default", f"--selector={selector}", "-o", "json"])
    )
    return sorted(s["metadata"]["name"] for s in listing["items"])
