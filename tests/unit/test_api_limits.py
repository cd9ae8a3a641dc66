"""Input the models must refuse (phase Invalid), not crash on: every canary rule in the models, bounded
replicas, quantities and sizes past what any cluster holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from tests.support.manifests import with_change

from mooncake_operator.api.crd import openapi_schema
from mooncake_operator.api.examples import reference_deployment_yaml
from mooncake_operator.api.resource import InvalidResourceError, parse_resource
from mooncake_operator.api.spec import MAX_REPLICAS
from mooncake_operator.canary.models import CanaryConfig
from mooncake_operator.cli.main import main

pytestmark = pytest.mark.unit


def example(path: str, value: Any) -> dict[str, Any]:
    return with_change(yaml.safe_load(reference_deployment_yaml()), path, value)


def problems_of(obj: dict[str, Any]) -> list[str]:
    with pytest.raises(InvalidResourceError) as caught:
        parse_resource(obj)
    return caught.value.problems


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("spec.canary.expectations", [{"kind": "no_such_check"}], "spec.canary.expectations: 0: Input tag"),
        ("spec.canary.expectations", [{"kind": "contains"}], "spec.canary.expectations: 0.contains.text"),
        ("spec.canary.request", {"messages": []}, "spec.canary.request: the request needs a non-empty"),
        ("spec.canary.request", {"messages": [{"role": "user"}], "stream": True}, "must not stream"),
        (
            "spec.canary.request",
            {"messages": [{"role": "user"}], "cache_salt": "x"},
            "must not set 'cache_salt'",
        ),
    ],
)
def test_every_canary_rule_is_a_model_rule(path: str, value: Any, message: str) -> None:
    problems = problems_of(example(path, value))
    assert any(message in problem for problem in problems), problems


def test_a_disabled_canary_is_not_checked() -> None:
    obj = example("spec.canary.expectations", [{"kind": "no_such_check"}])
    obj["spec"]["canary"]["enabled"] = False
    parse_resource(obj)


def test_render_refuses_what_the_operator_would_mark_invalid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mcs.yaml"
    path.write_text(yaml.safe_dump(example("spec.canary.expectations", [{"kind": "no_such_check"}])))
    assert main(["render", "-f", str(path)]) == 3
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "spec.canary.expectations: 0: Input tag 'no_such_check'" in captured.err


def test_replicas_are_bounded_in_the_models_and_the_crd() -> None:
    assert MAX_REPLICAS == 64
    problems = problems_of(example("spec.replicas", MAX_REPLICAS + 1))
    assert problems == ["spec.replicas: Input should be less than or equal to 64"]
    parse_resource(example("spec.replicas", MAX_REPLICAS))
    assert openapi_schema()["properties"]["spec"]["properties"]["replicas"]["maximum"] == MAX_REPLICAS


@pytest.mark.parametrize("field", ["clientTtlSeconds", "kvLeaseTtlSeconds"])
def test_the_master_ttls_are_bounded_in_the_models_and_the_crd(field: str) -> None:
    path = f"spec.store.master.{field}"
    assert problems_of(example(path, 0)) == [f"{path}: Input should be greater than or equal to 1"]
    assert problems_of(example(path, 3601)) == [f"{path}: Input should be less than or equal to 3600"]
    assert problems_of(example(path, "a minute")) == [f"{path}: Input should be a valid integer"]
    parse_resource(example(path, 3600))
    master = openapi_schema()["properties"]["spec"]["properties"]["store"]["properties"]["master"]
    assert (master["properties"][field]["minimum"], master["properties"][field]["maximum"]) == (1, 3600)


def test_the_duplicate_replica_check_names_each_repeat_once_in_a_long_list() -> None:
    # Its speed over 60,000 URLs is measured in bench/hostile_inputs.py, not timed here.
    urls = [f"http://10.0.{index // 250}.{index % 250}:8000" for index in range(60_000)]
    CanaryConfig(replicas=urls)
    with pytest.raises(
        ValidationError, match=r"repeated: http://10\.0\.0\.1:8000, http://10\.0\.239\.249:8000 \["
    ):
        CanaryConfig(replicas=[*urls, urls[-1], urls[1], urls[1]])


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("spec.engine.resources.limits", {"memory": "1e999999999"}, "too large"),
        ("spec.engine.resources.requests", {"cpu": "1e999999999999999999999"}, "quantity"),
        ("spec.engine.resources.requests", {"memory": "9" * 5000 + "Gi"}, "too large"),
        ("spec.engine.sharedMemorySize", "1E999999999", "too large"),
        ("spec.store.globalSegmentSize", "9" * 5000 + "GB", "too large"),
        ("spec.store.localBufferSize", "9" * 30 + "GB", "too large"),
    ],
)
def test_absurd_quantities_are_invalid_not_exceptions(path: str, value: Any, message: str) -> None:
    problems = problems_of(example(path, value))
    assert any(message in problem for problem in problems), problems


def test_absurd_quantities_do_not_crash_render(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "mcs.yaml"
    path.write_text(yaml.safe_dump(example("spec.store.globalSegmentSize", "9" * 5000 + "GB")))
    assert main(["render", "-f", str(path)]) == 3
    assert "too large" in capsys.readouterr().err
