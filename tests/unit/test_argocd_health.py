"""The shipped Argo CD health check (charts/mooncake-operator/argocd/health.lua), run by a real Lua 5.1
interpreter (Argo CD runs gopher-lua, a Lua 5.1) against statuses the operator's own helpers write, one for
every phase: Healthy only when Ready, Degraded on CanaryFailed/Invalid (and Stalled), Progressing otherwise.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, get_args

import pytest

from mooncake_operator.api.status import MooncakeServingStatus, Phase
from mooncake_operator.reconcile.decide import conditions as cond
from mooncake_operator.reconcile.decide import status as status_module
from mooncake_operator.reconcile.decide.conditions import ConditionState, Reason, merge_conditions

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
HEALTH_LUA = REPO / "charts" / "mooncake-operator" / "argocd" / "health.lua"
GITOPS_DOC = REPO / "docs" / "gitops.md"
LUA = "lua5.1"


def lua_literal(value: Any) -> str:
    """A Python JSON value as a Lua table constructor (what Argo CD hands the script as `obj`)."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        assert all(ord(ch) >= 32 for ch in value), "control characters would need Lua escapes"
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "{" + ", ".join(lua_literal(item) for item in value) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"[{lua_literal(k)}] = {lua_literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(type(value))


def health(obj: dict[str, Any], tmp_path: Path) -> tuple[str, str]:
    lua = shutil.which(LUA)
    if lua is None:
        pytest.fail(f"{LUA} is not installed: run scripts/bootstrap (apt-get install lua5.1)")
    runner = tmp_path / "run.lua"
    runner.write_text(
        f"obj = {lua_literal(obj)}\n"
        f"local hs = dofile({json.dumps(str(HEALTH_LUA))})\n"
        'io.write(hs.status, "\\n", hs.message)\n',
        encoding="utf-8",
    )
    done = subprocess.run([lua, str(runner)], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    state, _, message = done.stdout.partition("\n")
    return state, message


ALL_TRUE = {
    cond.MASTER_READY: cond.true(Reason.MASTER_READY),
    cond.REPLICAS_READY: cond.true(Reason.REPLICAS_READY),
    cond.CANARY_PASSED: cond.true(Reason.CANARY_PASSED, "run 1"),
}


def resource(
    phase: Phase, ready: ConditionState, *, generation: int = 3, observed: int | None = 3
) -> dict[str, Any]:
    conditions = merge_conditions(
        [], {**ALL_TRUE, cond.READY: ready}, now="2026-12-02T00:00:00Z", generation=observed
    )
    written = MooncakeServingStatus(phase=phase, observed_generation=observed, conditions=conditions)
    return {
        "apiVersion": "serving.mooncake-operator.dev/v1alpha1",
        "kind": "MooncakeServing",
        "metadata": {"name": "m", "namespace": "default", "generation": generation},
        "status": written.to_wire(),
    }


def invalid_sample() -> dict[str, Any]:
    reported = status_module.invalid(["spec.replicas: must be >= 2"])
    obj = resource("Invalid", reported.conditions[cond.READY])
    assert reported.phase == "Invalid"
    return obj


# One status per phase the operator writes, with the Ready it writes in that phase (decide/status.py).
SAMPLES: dict[str, tuple[Any, str]] = {
    "Pending": (lambda: resource("Pending", cond.false(Reason.PENDING, "waiting for pods")), "Progressing"),
    "Deploying": (lambda: resource("Deploying", cond.false(Reason.DEPLOYING, "rolling out")), "Progressing"),
    "Canary": (lambda: resource("Canary", cond.false(Reason.CANARY_RUNNING, "run 2")), "Progressing"),
    "Ready": (lambda: resource("Ready", cond.true(Reason.READY, "proven by run 2")), "Healthy"),
    "CanaryFailed": (
        lambda: resource("CanaryFailed", cond.false(Reason.CANARY_FAILED, "warm != cold")),
        "Degraded",
    ),
    "Degraded": (lambda: resource("Degraded", cond.false(Reason.REPLICAS_LOST, "1/2 ready")), "Progressing"),
    "Invalid": (invalid_sample, "Degraded"),
}


def test_samples_cover_every_phase() -> None:
    assert set(SAMPLES) == set(get_args(Phase))


@pytest.mark.parametrize("phase", sorted(SAMPLES))
def test_health_of_every_phase(phase: str, tmp_path: Path) -> None:
    build, expected = SAMPLES[phase]
    obj = build()
    state, message = health(obj, tmp_path)
    assert state == expected
    ready = next(c for c in obj["status"]["conditions"] if c["type"] == "Ready")
    assert message == f"{phase}: {ready['message']}"


def test_no_status_yet_is_progressing(tmp_path: Path) -> None:
    obj = {"metadata": {"name": "m", "generation": 1}}
    assert health(obj, tmp_path) == ("Progressing", "Waiting for the operator to report status")


def test_a_ready_status_of_an_older_generation_is_progressing(tmp_path: Path) -> None:
    obj = resource("Ready", cond.true(Reason.READY, "proven"), generation=4, observed=3)
    assert health(obj, tmp_path) == ("Progressing", "Waiting for the operator to observe generation 4")


def test_a_rolled_back_resource_is_stalled_and_degraded(tmp_path: Path) -> None:
    obj = resource("Degraded", cond.false(Reason.ROLLED_BACK, "serving abc; def failed"))
    assert health(obj, tmp_path) == ("Degraded", "Degraded: serving abc; def failed")


def test_a_condition_without_message_and_a_status_without_conditions(tmp_path: Path) -> None:
    obj = resource("Ready", cond.true(Reason.READY))
    assert health(obj, tmp_path) == ("Healthy", "Ready")
    bare = {"metadata": {"generation": 2}, "status": {"phase": "Deploying", "observedGeneration": 2}}
    assert health(bare, tmp_path) == ("Progressing", "Deploying")


def test_the_gitops_page_ships_the_same_script() -> None:
    doc = GITOPS_DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", doc, re.DOTALL)
    key = "resource.customizations.health.serving.mooncake-operator.dev_MooncakeServing: |\n"
    embedded = [block.split(key, 1)[1] for block in blocks if key in block]
    assert len(embedded) == 1, "docs/gitops.md must show the argocd-cm entry once"
    lines = embedded[0].splitlines()
    indent = len(lines[0]) - len(lines[0].lstrip())
    script = "\n".join(line[indent:] for line in lines) + "\n"
    assert script == HEALTH_LUA.read_text(encoding="utf-8")
