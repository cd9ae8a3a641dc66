"""The last-good ConfigMap is trusted only when its digest is the one status.lastGoodRevision recorded."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mooncake_operator.api.examples import reference_deployment
from mooncake_operator.build.digests import spec_hash
from mooncake_operator.reconcile.decide import status
from mooncake_operator.reconcile.decide.conditions import READY
from mooncake_operator.reconcile.decide.revisions import SPEC_KEY, last_good_manifest, verified_last_good

pytestmark = pytest.mark.unit

RESOURCE = reference_deployment()
GOOD = spec_hash(RESOURCE.spec)


def stored(spec_json: str | None = None) -> dict[str, object]:
    manifest = last_good_manifest(RESOURCE, RESOURCE.spec, owner_uid="u")
    if spec_json is not None:
        manifest["data"] = {SPEC_KEY: spec_json}
    return manifest


def test_the_recorded_revision_is_trusted() -> None:
    last_good, refusal = verified_last_good(stored(), GOOD)
    assert refusal is None
    assert last_good is not None and last_good.spec_revision == GOOD


def test_an_edited_spec_is_refused_with_both_digests() -> None:
    wire = RESOURCE.spec.to_wire()
    wire["engine"]["image"] = "registry.invalid/someone-elses:latest"
    last_good, refusal = verified_last_good(stored(json.dumps(wire)), GOOD)
    assert last_good is None
    assert refusal is not None
    assert GOOD in refusal and "changed after the canary proved it" in refusal


def test_an_unreadable_spec_is_refused_when_one_was_recorded() -> None:
    last_good, refusal = verified_last_good(stored("{not json"), GOOD)
    assert last_good is None
    assert refusal is not None and "unreadable" in refusal
    # Nothing recorded yet (no canary passed): nothing to roll back to, nothing to refuse.
    assert verified_last_good(stored(), None) == (None, None)
    assert verified_last_good(None, GOOD)[1] is not None


def test_a_refused_rollback_is_in_the_ready_condition() -> None:
    from tests.unit.test_reconcile_status import READY_OBSERVATION, SPEC, run

    revisions = replace(SPEC, rollback_refused="the last-good ConfigMap was changed")
    verdict = status.settled(READY_OBSERVATION, revisions, run("Failed"), enabled=True, on_failure="Rollback")
    assert verdict.phase == "CanaryFailed"
    assert "Rollback refused: the last-good ConfigMap was changed." in verdict.conditions[READY].message
