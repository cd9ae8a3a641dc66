"""Whether a child must be written: missing, changed (hash), or drifted (a field no longer as rendered)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from mooncake_operator.api.examples import reference_deployment
from mooncake_operator.build.manifests import render_all
from mooncake_operator.reconcile.act.children import (
    APPLIED_HASH_ANNOTATION,
    holds,
    needs_apply,
    with_applied_hash,
)

pytestmark = pytest.mark.unit


def rendered() -> list[dict[str, Any]]:
    resource = reference_deployment()
    return [with_applied_hash(m) for m in render_all(resource, owner_uid="uid-1")]


def as_stored(manifest: dict[str, Any]) -> dict[str, Any]:
    """What the API server returns: our fields plus defaults and bookkeeping."""
    stored = copy.deepcopy(manifest)
    stored["metadata"].update(uid="u", resourceVersion="7", managedFields=[{"manager": "mooncake-operator"}])
    stored["status"] = {"observedGeneration": 1}
    if stored["kind"] == "StatefulSet":
        container = stored["spec"]["template"]["spec"]["containers"][0]
        container["terminationMessagePath"] = "/dev/termination-log"
        container["imagePullPolicy"] = "IfNotPresent"
        stored["spec"]["updateStrategy"]["rollingUpdate"] = {"partition": 0}
    if stored["kind"] == "Service" and "clusterIP" not in stored["spec"]:
        stored["spec"]["clusterIP"] = "10.96.0.12"
    return stored


def test_the_applied_hash_is_stable_and_follows_the_manifest() -> None:
    first, again = rendered(), rendered()
    assert [m["metadata"]["annotations"][APPLIED_HASH_ANNOTATION] for m in first] == [
        m["metadata"]["annotations"][APPLIED_HASH_ANNOTATION] for m in again
    ]
    hashes = {m["metadata"]["annotations"][APPLIED_HASH_ANNOTATION] for m in first}
    assert len(hashes) == len(first)


def test_nothing_to_do_when_the_stored_object_holds_the_rendered_one() -> None:
    for manifest in rendered():
        assert needs_apply(manifest, as_stored(manifest)) is None, manifest["kind"]


def test_missing_changed_and_drifted_children_are_written() -> None:
    manifest = next(m for m in rendered() if m["kind"] == "StatefulSet")
    assert needs_apply(manifest, None) == "missing"
    older = as_stored(manifest)
    older["metadata"]["annotations"][APPLIED_HASH_ANNOTATION] = "0000"
    assert needs_apply(manifest, older) == "changed"
    scaled = as_stored(manifest)
    scaled["spec"]["replicas"] = 5  # someone scaled it by hand
    assert needs_apply(manifest, scaled) == "drifted"
    extra_env = as_stored(manifest)
    extra_env["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "X", "value": "1"})
    assert needs_apply(manifest, extra_env) == "drifted"


@pytest.mark.parametrize(
    ("desired", "live", "expected"),
    [
        ({"a": 1}, {"a": 1, "b": 2}, True),
        ({"a": 1}, {"a": 2}, False),
        ({"a": [1, 2]}, {"a": [1, 2, 3]}, False),
        ({"cpu": 4}, {"cpu": "4"}, True),  # the API server writes quantities as strings
        ({"cpu": "0.5"}, {"cpu": "500m"}, True),
        ({"memory": "1Gi"}, {"memory": "1024Mi"}, True),
        ({"memory": "1Gi"}, {"memory": "1G"}, False),
        ({"name": "a"}, {"name": "b"}, False),
        ({"flag": True}, {"flag": "True"}, False),
    ],
)
def test_holds(desired: Any, live: Any, expected: bool) -> None:
    assert holds(desired, live) is expected
