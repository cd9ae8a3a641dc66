"""The fault tier's scenario harness: every scenario starts from a Ready resource, runs `ClientLoad` and
`ServedLedger` (fault_load.py), injects one fault, waits for its end state, and asserts what every
scenario must hold: no user request reached a pod instance before a canary covering it passed, every
answer users got was the same correct (greedy) text (or, for a change that legitimately changes it, a new
model revision, the old revision's text until recovery and the new one's after: `AnswerChange`), and
requests sent after recovery all succeeded.
Each prints one `FAULT-RESULT` JSON line with its measurements; `FAULT_RESULTS=FILE` appends them to
FILE (bench/RESULTS.md, "Faults on real pods")."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.support import cluster
from tests.support.cpu_stalls import stalls_during_test
from tests.support.fault_load import (
    ClientLoad,
    Response,
    ServedLedger,
    counted_since,
    failure_window,
    operator_counters,
    parse_time,
    replica_pods,
    wait_until,
)
from tests.support.kube_node import kubectl

from mooncake_operator.api.group import RERUN_CANARY_ANNOTATION
from mooncake_operator.build.names import TRAFFIC_LABEL

BASELINE_S = 12.0  # load before the fault: the reference answer, and a serving baseline
TAIL_S = 8.0  # load after recovery: every request in it must succeed
RECOVERY_TIMEOUT = 1200.0  # a canary run alone took up to 10+ min on the shared 2-core machine
SETTLE_S = 3.0  # kube-proxy's rules follow the EndpointSlices within this (later requests must succeed)
API_REQUESTS = "mooncake_operator_kube_requests_total"
CANARY_RUNS = "mooncake_operator_canary_runs_total"
OPERATOR_PODS = "app.kubernetes.io/name=mooncake-operator,app.kubernetes.io/component=operator"


def status_of(name: str) -> dict[str, Any]:
    status: dict[str, Any] = cluster.get_serving(name).get("status") or {}
    return status


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def proven_again_after(name: str, moment: float) -> Callable[[], bool]:
    """Ready, with a canary that started after `moment` (wall clock) and passed with an external hit,
    and every desired replica serving."""

    def probe() -> bool:
        status = status_of(name)
        canary = status.get("canary") or {}
        started = parse_time(canary.get("startedAt"))
        return (
            condition(status, "Ready").get("status") == "True"
            and canary.get("verdict") == "Passed"
            and started is not None
            and started.timestamp() >= int(moment)
            and (canary.get("externalHitTokens") or 0) > 0
            and (status.get("traffic") or {}).get("serving") == (status.get("replicas") or {}).get("desired")
        )

    return probe


def client_url(name: str) -> str:
    service = json.loads(kubectl(["get", "service", name, "--namespace=default", "-o", "json"]))
    return f"http://{service['spec']['clusterIP']}:8000/v1/chat/completions"


@dataclass(frozen=True)
class AnswerChange:
    """The scenario legitimately changes the answer users get (a new model revision). `before`, `after`:
    the old and the new revision's answers (hashes) where an earlier scenario measured them; None: measured
    here, the old one from the load before the change, the new one from the load after recovery."""

    before: str | None = None
    after: str | None = None


def unexpected_answers(
    responses: Sequence[Response],
    *,
    before: str | None,
    after: str | None,
    changed_at: float,
    settled_at: float,
) -> list[Response]:
    """The answers (200s) users must not have got: started before `changed_at`, anything but `before`;
    from `settled_at` on (recovered, the client Service settled), anything but `after` (None: no answer
    is expected then); in between, either. A scenario that changes nothing passes `after=before`."""
    allowed_after: set[str | None] = {after} if after is not None else set()
    wrong = []
    for response in responses:
        if response.status != 200:
            continue
        allowed: set[str | None]
        if response.started < changed_at:
            allowed = {before}
        elif response.started < settled_at:
            allowed = {before} | allowed_after
        else:
            allowed = allowed_after
        if response.body_hash not in allowed:
            wrong.append(response)
    return wrong


def run_scenario(
    scenario: str,
    name: str,
    inject: Callable[[], None],
    recovered: Callable[[float], Callable[[], bool]],
    *,
    on_poll: Callable[[], None] | None = None,
    change: AnswerChange | None = None,
) -> dict[str, Any]:
    """Load, fault, wait for `recovered(fault_wall_time)`, more load; returns the measurements after
    asserting what every scenario must hold (with `change`, also `answer_before` and `answer_after`),
    and under "responses" every response the load recorded (not reported)."""
    assert condition(status_of(name), "Ready").get("status") == "True", f"{name} not Ready before {scenario}"
    api_before = operator_counters(API_REQUESTS)
    canaries_before = operator_counters(CANARY_RUNS)
    log_dir = Path(tempfile.mkdtemp(prefix="fault-replica-logs-"))
    load_url, model = client_url(name), cluster.client_model_name()
    with ServedLedger(name, log_dir=log_dir) as ledger, ClientLoad(load_url, model) as load:
        time.sleep(BASELINE_S)
        baseline = [r for r in load.snapshot() if r.status == 200]
        assert baseline, f"no request succeeded before the fault: {load.snapshot()}"
        fault_wall, fault_at = time.time(), time.monotonic()
        inject()
        probe = recovered(fault_wall)

        def polled() -> bool:
            if on_poll is not None:
                on_poll()
            return probe()

        wait_until(f"{name} proven again after {scenario}", polled, RECOVERY_TIMEOUT)
        ready_at = time.monotonic()
        api_during = operator_counters(API_REQUESTS)
        canaries_during = operator_counters(CANARY_RUNS)
        time.sleep(TAIL_S)
    responses = load.snapshot()
    reference = {r.body_hash for r in baseline}
    assert len(reference) == 1, f"greedy answers differed before the fault: {reference}"
    (before,) = reference
    if change is not None and change.before is not None:
        assert before == change.before, f"the answer before the change is {before}, not {change.before}"
    settled_at = ready_at + SETTLE_S
    late = [r for r in responses if r.started > settled_at]
    after_answers = {r.body_hash for r in late if r.status == 200}
    if change is None:
        after: str | None = before
    else:
        after = next(iter(after_answers)) if len(after_answers) == 1 else None
    wrong = unexpected_answers(
        responses, before=before, after=after, changed_at=fault_at, settled_at=settled_at
    )
    failed, failed_for = failure_window(responses)
    # Errors: failures other than the load's own cap ("overloaded", replicas saturated), with when the
    # first and the last of them was sent, in seconds from the fault.
    errors = [r for r in responses if r.status not in (200, "overloaded")]
    errors_sent = [round(r.started - fault_at, 1) for r in (errors[0], errors[-1])] if errors else None
    late_failures = [r for r in late if r.status != 200]
    unproven = ledger.unproven_user_requests(born_after=fault_wall - 1)
    unproven_evidence = ledger.unproven_evidence(born_after=fault_wall - 1, since=fault_wall)
    result = {
        "scenario": scenario,
        "ready_again_s": round(ready_at - fault_at, 1),
        "requests": len(responses),
        "failed": failed,
        "failed_window_s": round(failed_for, 1),
        "failed_statuses": sorted({str(r.status) for r in responses if r.status != 200}),
        "errors": len(errors),
        "errors_sent_s": errors_sent,
        "wrong_answers": len(wrong),
        "unproven_user_requests": unproven,
        "canaries_run": counted_since(canaries_before, canaries_during),
        "operator_api_requests": counted_since(api_before, api_during),
        "p50_latency_s": median([r.latency_s for r in responses if r.status == 200]),
        "ledger_errors": len(ledger.errors),
        # Against canaries_run (the operator's count): a run the ledger never saw in the status would
        # make its requests look like users'.
        "canary_runs_seen": ledger.runs_started_after(fault_wall),
        # The platform's own stalls while the scenario ran (a failure inside one is the machine's, not
        # the product's; the fault tier reruns nothing): tests/support/cpu_stalls.py.
        "cpu_stalls": [stall.describe() for stall in stalls_during_test()],
    }
    if unproven_evidence:
        result["unproven_evidence"] = unproven_evidence
    if errors:
        # What the engines logged while those requests ran (pods since replaced included): the log
        # lines that can explain them, and where every replica's whole log is kept.
        window = [fault_wall + r.started - fault_at for r in errors]
        start = datetime.fromtimestamp(min(window) - 5, UTC)
        end = datetime.fromtimestamp(
            max(fault_wall + r.started - fault_at + r.latency_s for r in errors) + 5, UTC
        )
        result["replica_logs"] = str(log_dir)
        result["replica_log_at_errors"] = ledger.failure_evidence(start, end)
    if any(isinstance(r.status, int) and r.status >= 500 for r in responses):
        # A bare HTTP 500 from vLLM is most often a failed store load, said only in the replica's log.
        try:
            result["store_warnings"] = cluster.replica_store_warnings(name)
        except cluster.ClusterError as error:
            result["store_warnings"] = f"unreadable: {error}"
    if change is not None:
        during = [r for r in responses if r.status == 200 and fault_at <= r.started < settled_at]
        result |= {
            "answer_before": before,
            "answer_after": after,
            "answers_during": {
                "old": sum(r.body_hash == before for r in during),
                "new": sum(r.body_hash == after for r in during),
            },
        }
    report(result)
    assert not any(unproven.values()), f"user requests reached an unproven pod: {unproven}"
    assert not late_failures, f"requests failed after recovery: {late_failures[:5]}"
    if change is not None:
        assert after is not None, f"one answer after recovery expected (the new revision's): {after_answers}"
        assert after != before, "the new revision answers as the old one: the scenario cannot tell them apart"
        if change.after is not None:
            assert after == change.after, f"the new revision answered {after}, earlier {change.after}"
    assert not wrong, f"{len(wrong)} answers differ from the expected answers: {wrong[:3]}"
    return result | {"responses": responses}


def median(values: list[float]) -> float | None:
    return round(sorted(values)[len(values) // 2], 3) if values else None


def report(result: dict[str, Any]) -> None:
    line = json.dumps(result, sort_keys=True)
    print(f"FAULT-RESULT {line}", flush=True)
    target = os.environ.get("FAULT_RESULTS")
    if target:
        with open(target, "a", encoding="utf-8") as out:
            out.write(line + "\n")


def new_instances(result: dict[str, Any]) -> list[str]:
    return list(result["unproven_user_requests"])


def ask_for_a_canary(serving: str, rerun: str) -> None:
    """The rerun annotation, as a user sets it (docs/operator.md)."""
    kubectl(
        [
            "annotate",
            "mcs",
            serving,
            "--namespace=default",
            f"{RERUN_CANARY_ANNOTATION}={rerun}",
            "--overwrite",
        ]
    )


def client_endpoints(name: str) -> list[str]:
    """The ready addresses of the client Service's EndpointSlices: who gets user traffic. kube-proxy
    programs its rules from the slices, not from the Endpoints object, and the two are written by
    different controllers: CI once saw a connection refused half a second before the Endpoints object
    showed the Service empty."""
    selector = f"--selector=kubernetes.io/service-name={name}"
    return ready_addresses(
        json.loads(kubectl(["get", "endpointslices", selector, "--namespace=default", "-o", "json"]))
    )


def ready_addresses(slices: dict[str, Any]) -> list[str]:
    """The addresses of an EndpointSliceList's ready endpoints; one whose `ready` is unset counts as
    ready, as kube-proxy counts it."""
    return sorted(
        address
        for endpoint_slice in slices.get("items") or []
        for endpoint in endpoint_slice.get("endpoints") or []
        if (endpoint.get("conditions") or {}).get("ready") is not False
        for address in endpoint.get("addresses") or []
    )


def traffic_labels(name: str) -> dict[str, str | None]:
    return {p["metadata"]["name"]: p["metadata"]["labels"].get(TRAFFIC_LABEL) for p in replica_pods(name)}
