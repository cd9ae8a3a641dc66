"""The alert rules (charts/mooncake-operator/files/prometheus-rules.yaml) under Debian's promtool."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.support.prometheus import REPO_ROOT, promtool

pytestmark = pytest.mark.unit

RULES = REPO_ROOT / "charts" / "mooncake-operator" / "files" / "prometheus-rules.yaml"
RULE_TESTS = Path(__file__).parent / "promtool" / "rules.test.yaml"
RUNBOOKS = REPO_ROOT / "docs" / "runbooks.md"
CHART = REPO_ROOT / "charts" / "mooncake-operator" / "Chart.yaml"
# The recording rule that tells a resource that has served users from one that never has.
HAS_BEEN_READY = "mooncake:has_been_ready:1d"


def alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_promtool_checks_the_rules() -> None:
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_promtool_unit_tests_pass() -> None:
    tested = promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    cases = [
        case for test in yaml.safe_load(RULE_TESTS.read_text())["tests"] for case in test["alert_rule_test"]
    ]
    for alert in alerts():
        name = alert["alert"]
        mine = [case for case in cases if case["alertname"] == name]
        assert any(case.get("exp_alerts") for case in mine), f"{name}: no case where it fires"
        assert any(not case.get("exp_alerts") for case in mine), f"{name}: no case where it stays quiet"


def test_every_alert_is_labelled_annotated_and_has_a_runbook_section() -> None:
    runbooks = RUNBOOKS.read_text()
    for alert in alerts():
        name = alert["alert"]
        assert alert["labels"]["severity"] in ("critical", "warning", "info"), name
        annotations = alert["annotations"]
        assert annotations["summary"] and annotations["description"], name
        assert annotations["runbook_url"] == f"{published_runbooks()}#{name.lower()}", name
        section = runbooks.split(f"\n## {name}\n", 1)
        assert len(section) == 2, f"docs/runbooks.md has no section '## {name}'"
        body = section[1].split("\n## ", 1)[0]
        for part in ("### Summary", "### Impact", "### Diagnosis", "### Resolution"):
            assert part in body, f"{name}: runbook lacks {part}"


def test_a_rule_that_does_not_parse_is_refused(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(RULES.read_text().replace("== 1", "== = 1", 1))
    assert promtool("check", "rules", str(broken)).returncode != 0


def published_runbooks() -> str:
    """This release's published runbooks: the base the plain file carries and the chart's default."""
    version = yaml.safe_load(CHART.read_text())["appVersion"]
    return f"https://mooncake-operator.dev/docs/v{version}/runbooks"


def test_no_page_for_a_resource_that_has_never_been_ready() -> None:
    """A critical alert on a MooncakeServing's own series requires it to have been Ready: a first rollout
    loads weights for up to an hour and has no users to lose (MooncakeFirstRolloutSlow warns instead)."""
    per_resource = [
        alert
        for alert in alerts()
        if alert["labels"]["severity"] == "critical"
        and "{{ $labels.name }}" in alert["annotations"]["summary"]
    ]
    assert {alert["alert"] for alert in per_resource} == {
        "MooncakeCanaryFailed",
        "MooncakeNoReplicaServing",
        "MooncakeMasterNoLeader",
    }
    for alert in per_resource:
        assert f"and on (namespace, name) {HAS_BEEN_READY}" in alert["expr"], alert["alert"]
    first_rollout = [alert for alert in alerts() if alert["alert"] == "MooncakeFirstRolloutSlow"]
    assert [alert["labels"]["severity"] for alert in first_rollout] == ["warning"]
    assert f"unless on (namespace, name) {HAS_BEEN_READY}" in first_rollout[0]["expr"]
