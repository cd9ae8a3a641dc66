"""The opt-in InferencePool: absent unless asked for; its selector is exactly the client Service's (the
proven-traffic label included), its port the engine's, its endpoint picker the one the user names, and
FailClose unless the user chose FailOpen."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from tests.unit.test_template_stability import REPO

from mooncake_operator.api.resource import InvalidResourceError, parse_resource
from mooncake_operator.build.inference_pool import inference_pool
from mooncake_operator.build.manifests import render_all
from mooncake_operator.build.names import TRAFFIC_LABEL, TRAFFIC_ON
from mooncake_operator.build.services import client_service

pytestmark = pytest.mark.unit


def quickstart(**spec: Any) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text(encoding="utf-8"))
    body["spec"].update(spec)
    return body


def test_no_pool_unless_asked_for() -> None:
    resource = parse_resource(quickstart())
    assert inference_pool(resource, owner_uid="u") is None
    assert "InferencePool" not in [m["kind"] for m in render_all(resource, owner_uid="u")]


def test_the_pool_admits_only_proven_pods_through_the_named_picker() -> None:
    resource = parse_resource(quickstart(inferencePool={"endpointPicker": {"name": "epp", "port": 9002}}))
    pool = inference_pool(resource, owner_uid="u")
    assert pool is not None and pool["apiVersion"] == "inference.networking.k8s.io/v1"
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector == client_service(resource, owner_uid="u")["spec"]["selector"]
    assert selector[TRAFFIC_LABEL] == TRAFFIC_ON
    assert pool["spec"]["targetPorts"] == [{"number": resource.spec.engine.port}]
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service",
        "name": "epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    assert pool["metadata"]["name"] == resource.metadata.name
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "u"
    assert render_all(resource, owner_uid="u")[-1] == pool


def test_fail_open_and_another_kind_are_the_users_choice() -> None:
    picker = {
        "name": "epp",
        "port": 9002,
        "failureMode": "FailOpen",
        "kind": "Gateway",
        "group": "example.com",
    }
    pool = inference_pool(
        parse_resource(quickstart(inferencePool={"endpointPicker": picker})), owner_uid=None
    )
    assert pool is not None
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert pool["spec"]["endpointPickerRef"]["group"] == "example.com"


@pytest.mark.parametrize(
    "picker",
    [
        {"port": 9002},
        {"name": "epp"},
        {"name": "epp", "port": 0},
        {"name": "epp", "port": 9002, "failureMode": "Maybe"},
    ],
)
def test_an_incomplete_picker_is_refused(picker: dict[str, Any]) -> None:
    with pytest.raises(InvalidResourceError):
        parse_resource(quickstart(inferencePool={"endpointPicker": picker}))
