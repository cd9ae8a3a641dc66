"""build/ownership.py: who controls an object, by its controller reference (exact answers)."""

from __future__ import annotations

from typing import Any

import pytest

from mooncake_operator.api.examples import reference_deployment
from mooncake_operator.api.group import API_VERSION, KIND
from mooncake_operator.build.names import owner_reference
from mooncake_operator.build.ownership import controlled_by, controller_reference, owner_references

pytestmark = pytest.mark.unit


def child(*references: Any) -> dict[str, Any]:
    return {"metadata": {"name": "x", "ownerReferences": list(references)}}


CONTROLLER = {"apiVersion": API_VERSION, "kind": KIND, "name": "chat", "uid": "u1", "controller": True}


def test_the_builders_reference_is_what_the_readers_accept() -> None:
    resource = reference_deployment()
    written = child(owner_reference(resource, "u1"))
    assert owner_reference(resource, "u1") == {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": resource.metadata.name,
        "uid": "u1",
        "controller": True,
        "blockOwnerDeletion": True,
    }
    assert controlled_by(written, KIND, "u1")
    assert controlled_by(written, KIND, None, api_version=API_VERSION, any_uid=True)


def test_only_the_controller_reference_counts() -> None:
    plain_owner = {**CONTROLLER, "controller": False}
    assert controller_reference(child(plain_owner)) is None
    assert not controlled_by(child(plain_owner), KIND, "u1")
    assert controller_reference(child(plain_owner, CONTROLLER)) == CONTROLLER


@pytest.mark.parametrize(
    ("obj", "kind", "uid", "extra", "expected"),
    [
        (child(CONTROLLER), KIND, "u1", {}, True),
        (child(CONTROLLER), KIND, "u2", {}, False),  # re-created under the name: another owner
        (child(CONTROLLER), KIND, None, {}, False),  # the UID unknown: never
        (child(CONTROLLER), KIND, "", {}, False),
        (child(CONTROLLER), "StatefulSet", "u1", {}, False),
        (child(CONTROLLER), KIND, "u1", {"api_version": "serving.example/v1"}, False),
        (child(CONTROLLER), KIND, None, {"any_uid": True}, True),
        (
            child({**CONTROLLER, "apiVersion": "x/v1"}),
            KIND,
            None,
            {"any_uid": True, "api_version": API_VERSION},
            False,
        ),
        ({"metadata": {}}, KIND, "u1", {}, False),
        ({}, KIND, None, {"any_uid": True}, False),
    ],
)
def test_controlled_by(
    obj: dict[str, Any], kind: str, uid: str | None, extra: dict[str, Any], expected: bool
) -> None:
    assert controlled_by(obj, kind, uid, **extra) is expected


def test_malformed_references_are_ignored() -> None:
    obj = child("not a mapping", 3, CONTROLLER)
    assert owner_references(obj) == [CONTROLLER]
    assert controlled_by(obj, KIND, "u1")
