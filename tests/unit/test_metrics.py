"""The operator's metrics: per-resource series from the written status, bounded labels, the exposition."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
import pytest
from tests.support.prometheus import REPO_ROOT, promtool

from mooncake_operator.api.status import CanaryStatus, MooncakeServingStatus, PairEvidence
from mooncake_operator.reconcile.act.slots import CanarySlots
from mooncake_operator.runtime.metrics import CanaryCause, OperatorMetrics, canary_cause, serve

pytestmark = pytest.mark.unit

FINISHED = "2026-12-01T10:00:05Z"
FINISHED_S = 1796119205.0


def pair(verdict: str = "Passed", reason: str = "", **changes: Any) -> PairEvidence:
    fields: dict[str, Any] = {
        "writer": "demo-replica-0",
        "reader": "demo-replica-1",
        "verdict": verdict,
        "reason": reason,
        "cache_salt": "canary-0123456789ab-0-ffff",
        "external_hit_tokens": 96,
        "expected_external_hit_tokens": 96,
        "answers_equal": True,
        "cold_latency_ms": 1200.0,
        "warm_latency_ms": 300.0,
        **changes,
    }
    return PairEvidence.model_validate(fields)


def canary(
    verdict: str = "Passed", reason: str = "", pairs: list[PairEvidence] | None = None
) -> CanaryStatus:
    return CanaryStatus(
        run_id="0123456789ab",
        verdict=verdict,  # type: ignore[arg-type]
        reason=reason,
        external_hit_tokens=96,
        started_at="2026-12-01T10:00:00Z",
        finished_at=FINISHED,
        pairs=pairs if pairs is not None else [pair()],
    )


def status(**changes: Any) -> MooncakeServingStatus:
    fields: dict[str, Any] = {
        "phase": "Ready",
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "CanaryPassed", "lastTransitionTime": FINISHED},
            {"type": "CanaryPassed", "status": "True", "reason": "Passed", "lastTransitionTime": FINISHED},
        ],
        "replicas": {"desired": 3, "ready": 3},
        "traffic": {
            "serving": 1,
            "pods": [
                {"name": "demo-replica-0", "uid": "u0", "serving": True},
                {"name": "demo-replica-1", "uid": "u1", "serving": False},
                {"name": "demo-replica-2", "uid": "u2", "serving": False},
            ],
        },
        "outOfTraffic": ["demo-replica-1"],
        "servingRevision": "rev-1",
        "rollout": {"strategy": "InPlace"},
    }
    fields.update(changes)
    model = MooncakeServingStatus.model_validate(fields)
    return model if "canary" in changes else model.model_copy(update={"canary": canary()})


def sample(metrics: OperatorMetrics, metric: str, /, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(metric, labels)


def test_a_status_becomes_state_sets_and_gauges() -> None:
    metrics = OperatorMetrics()
    metrics.record_status("ns", "demo", status())
    key = {"namespace": "ns", "name": "demo"}
    assert sample(metrics, "mooncake_operator_ready", **key) == 1
    assert sample(metrics, "mooncake_operator_phase", **key, phase="Ready") == 1
    assert sample(metrics, "mooncake_operator_phase", **key, phase="Degraded") == 0
    assert sample(metrics, "mooncake_operator_condition", **key, type="CanaryPassed", status="True") == 1
    assert sample(metrics, "mooncake_operator_condition", **key, type="CanaryPassed", status="False") == 0
    replicas = {
        state: sample(metrics, "mooncake_operator_replicas", **key, state=state)
        for state in ("desired", "ready", "serving", "held", "unproven")
    }
    assert replicas == {"desired": 3, "ready": 3, "serving": 1, "held": 1, "unproven": 1}
    assert sample(metrics, "mooncake_operator_canary_verdict", **key, verdict="Passed") == 1
    assert sample(metrics, "mooncake_operator_canary_verdict", **key, verdict="Failed") == 0
    assert sample(metrics, "mooncake_operator_canary_cause", **key, cause="none") == 1
    assert sample(metrics, "mooncake_operator_canary_finished_timestamp_seconds", **key) == FINISHED_S
    assert sample(metrics, "mooncake_operator_canary_last_passed_timestamp_seconds", **key) == FINISHED_S
    assert sample(metrics, "mooncake_operator_canary_external_hit_tokens", **key) == 96
    assert sample(metrics, "mooncake_operator_canary_expected_external_hit_tokens", **key) == 96
    assert sample(metrics, "mooncake_operator_canary_latency_seconds", **key, path="cold") == 1.2
    assert sample(metrics, "mooncake_operator_canary_latency_seconds", **key, path="warm") == 0.3
    # Without highly available masters there is no leader to report.
    assert sample(metrics, "mooncake_operator_master_leader_present", **key) is None


def test_a_failed_run_keeps_the_last_pass_and_names_its_cause() -> None:
    metrics = OperatorMetrics()
    metrics.record_status("ns", "demo", status())
    wrong = pair("Failed", "warm answer differs", answers_equal=False)
    failed = canary("Failed", "1 of 1 pairs failed", [wrong]).model_copy(
        update={"finished_at": "2026-12-01T11:00:00Z"}
    )
    metrics.record_status("ns", "demo", status(phase="CanaryFailed", canary=failed))
    key = {"namespace": "ns", "name": "demo"}
    assert sample(metrics, "mooncake_operator_canary_verdict", **key, verdict="Failed") == 1
    assert sample(metrics, "mooncake_operator_canary_verdict", **key, verdict="Passed") == 0
    assert sample(metrics, "mooncake_operator_canary_cause", **key, cause="answer_mismatch") == 1
    assert sample(metrics, "mooncake_operator_canary_cause", **key, cause="none") == 0
    assert sample(metrics, "mooncake_operator_canary_last_passed_timestamp_seconds", **key) == FINISHED_S


@pytest.mark.parametrize(
    ("verdict", "reason", "changes", "cause"),
    [
        (
            "Failed",
            "warm answer: no JSON object",
            {"violations": ["warm answer: no JSON object"]},
            "expectation_violated",
        ),
        (
            "Inconclusive",
            "reader's vllm:external_prefix_cache_hits_total did not rise: the warm answer was computed",
            {},
            "no_external_hit",
        ),
        (
            "Inconclusive",
            "reader loaded 32 tokens from the store, expected 96: "
            "the warm path did not cover the whole stored prefix",
            {},
            "hit_short",
        ),
        (
            "Inconclusive",
            "reader's counters unavailable: GET http://r/metrics: no complete answer within 10 s",
            {},
            "metrics_unreadable",
        ),
        (
            "Inconclusive",
            "cold request: cannot connect to http://r (3 attempts): refused",
            {},
            "replica_unreachable",
        ),
        (
            "Failed",
            "warm request: POST http://r/v1/chat/completions: no complete answer within 120 s",
            {},
            "timeout",
        ),
        ("Failed", "warm request: HTTP 500: KV load failure", {}, "load_failed"),
        ("Failed", "warm request: HTTP 400 bad request", {}, "request_failed"),
        (
            "Inconclusive",
            "the writer's store rejected 3 of the 4 keys it tried to save",
            {},
            "store_save_failed",
        ),
        ("Inconclusive", "reader's counters went down between the reads", {}, "counters_reset"),
        ("Inconclusive", "something no rule knows", {}, "other"),
    ],
)
def test_the_cause_is_a_bounded_enum(verdict: str, reason: str, changes: dict[str, Any], cause: str) -> None:
    evidence = pair(verdict, reason, **changes)
    assert canary_cause(canary(verdict, f"1 of 1 pairs: {reason}", [evidence])) is CanaryCause(cause)


def test_a_run_that_could_not_start_is_not_run() -> None:
    reason = "the operator's replica endpoints list 1 URLs for ns/demo, but spec.replicas is 2"
    assert canary_cause(canary("Inconclusive", reason, [])) is CanaryCause.NOT_RUN


def test_rollouts_count_steps_between_written_statuses_only() -> None:
    metrics = OperatorMetrics()
    metrics.record_status("ns", "demo", status())  # the first status seen: written before, not counted again
    metrics.record_status("ns", "demo", status(servingRevision="rev-2"))
    metrics.record_status("ns", "demo", status(servingRevision="rev-1", failedRevision="rev-2"))
    held = {"strategy": "BlueGreen", "candidateSet": "demo-replica-b", "candidatePhase": "Held"}
    metrics.record_status("ns", "demo", status(servingRevision="rev-1", failedRevision="rev-2", rollout=held))
    metrics.record_status("ns", "demo", status(servingRevision="rev-1", failedRevision="rev-2", rollout=held))
    key = {"namespace": "ns", "name": "demo"}
    rollouts = "mooncake_operator_rollouts_total"
    assert sample(metrics, rollouts, **key, strategy="InPlace", outcome="promoted") == 1
    assert sample(metrics, rollouts, **key, strategy="InPlace", outcome="rolled_back") == 1
    assert sample(metrics, rollouts, **key, strategy="BlueGreen", outcome="held") == 1


def test_masters_leader_and_failovers_come_from_the_status() -> None:
    metrics = OperatorMetrics()
    metrics.record_status("ns", "demo", status(highAvailability={"leader": None, "failovers": 4}))
    key = {"namespace": "ns", "name": "demo"}
    assert sample(metrics, "mooncake_operator_master_leader_present", **key) == 0
    assert sample(metrics, "mooncake_operator_master_failovers_total", **key) == 4


def test_a_deleted_resource_leaves_no_series() -> None:
    metrics = OperatorMetrics()
    metrics.record_status("ns", "demo", status())
    metrics.record_status("ns", "other", status())
    metrics.apply_failed("ns", "demo", "StatefulSet", 422)
    assert (
        sample(
            metrics,
            "mooncake_operator_apply_failures_total",
            namespace="ns",
            name="demo",
            kind="StatefulSet",
            code="422",
        )
        == 1
    )
    metrics.forget("ns", "demo")
    page = metrics.exposition()
    assert 'name="demo"' not in page
    assert 'name="other"' in page


def test_no_label_carries_a_run_id_a_salt_or_a_pod() -> None:
    metrics = OperatorMetrics()
    metrics.record_status("ns", "demo", status())
    page = metrics.exposition()
    for unbounded in ("0123456789ab", "canary-", "demo-replica", "rev-1", "u0"):
        assert unbounded not in page


def test_process_platform_and_build_info_are_exported() -> None:
    page = OperatorMetrics().exposition()
    for name in (
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "process_open_fds",
        "python_info",
    ):
        assert re.search(rf"^{name}\b", page, re.MULTILINE), name
    assert re.search(
        r'^mooncake_operator_build_info\{python_version="[\d.]+",version="[^"]+"\} 1.0$', page, re.MULTILINE
    )


async def test_canaries_are_counted_waiting_then_running() -> None:
    metrics = OperatorMetrics()
    slots = CanarySlots(total=1, per_namespace=1)
    first_in, release = asyncio.Event(), asyncio.Event()

    async def run() -> None:
        with metrics.canary_queue() as started:

            async def canary() -> None:
                started()
                first_in.set()
                await release.wait()

            await slots.run("ns", 60, canary)

    tasks = [asyncio.create_task(run()), asyncio.create_task(run())]
    await first_in.wait()
    await asyncio.sleep(0)
    assert sample(metrics, "mooncake_operator_canaries", state="running") == 1
    assert sample(metrics, "mooncake_operator_canaries", state="waiting") == 1
    release.set()
    await asyncio.gather(*tasks)
    assert sample(metrics, "mooncake_operator_canaries", state="running") == 0
    assert sample(metrics, "mooncake_operator_canaries", state="waiting") == 0


def populated() -> OperatorMetrics:
    """Every family with samples: a resource with highly available masters, a rollout, an apply failure."""
    metrics = OperatorMetrics()
    metrics.count_requests(lambda: {"get": 3, "patch_status": 1})
    metrics.record_status("ns", "demo", status(highAvailability={"leader": "demo-master-0", "failovers": 1}))
    metrics.record_status("ns", "demo", status(servingRevision="rev-2"))
    metrics.apply_failed("ns", "demo", "StatefulSet", 422)
    metrics.reconcile_duration.observe(0.2)
    metrics.canary_duration.observe(3.0)
    return metrics


def served_page(metrics: OperatorMetrics) -> str:
    server = serve(metrics, "127.0.0.1", 0)
    try:
        return httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=10, trust_env=False).text
    finally:
        server.stop()


def test_promtool_accepts_the_served_page() -> None:
    page = served_page(populated())
    assert "mooncake_operator_rollouts_total" in page
    checked = promtool("check", "metrics", stdin=page)
    assert checked.returncode == 0 and not checked.stdout.strip(), checked.stdout + checked.stderr


def test_promtool_would_catch_a_badly_named_metric() -> None:
    bad = (
        "# HELP demo_bytes_count a counter not ending in _total\n"
        "# TYPE demo_bytes_count counter\ndemo_bytes_count 1\n"
    )
    assert promtool("check", "metrics", stdin=bad).returncode != 0


def documented_metrics() -> dict[str, str]:
    text = (REPO_ROOT / "docs" / "operator.md").read_text()
    section = text[text.index("## Metrics (`--metrics-port`") :]
    section = section.split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(mooncake_operator_\w+)` \| (\w+) \|", section, re.MULTILINE))


def test_the_docs_table_lists_exactly_what_metrics_serves() -> None:
    page = served_page(populated())
    served = {}
    for family, kind in re.findall(r"^# TYPE (mooncake_operator_\w+) (\w+)$", page, re.MULTILINE):
        if family.endswith("_created"):  # prometheus_client's creation time of each counter and histogram
            continue
        served[family + ("_total" if kind == "counter" and not family.endswith("_total") else "")] = kind
    assert documented_metrics() == served
