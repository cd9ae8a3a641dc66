"""The generated CRD: committed copy up to date, structural, and agreeing with the models."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from mooncake_operator.api.crd import CRD_FILENAME, crd_yaml, custom_resource_definition, openapi_schema
from mooncake_operator.api.examples import reference_deployment_yaml
from mooncake_operator.api.quantities import STORE_SIZE_PATTERN, parse_store_size
from mooncake_operator.api.resource import InvalidResourceError, parse_resource
from mooncake_operator.api.status import (
    CanaryStatus,
    Condition,
    MooncakeServingStatus,
    PairEvidence,
    ReplicaCounts,
)
from mooncake_operator.cli.main import main

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "crds" / CRD_FILENAME

# Keywords pydantic emits that a structural schema must not carry.
FORBIDDEN = {"$ref", "$defs", "anyOf", "oneOf", "allOf", "title", "const", "examples", "exclusiveMinimum"}


def test_committed_crd_matches_the_models() -> None:
    assert COMMITTED.exists(), f"{COMMITTED} is missing: run `mooncake-operator crd --output-dir crds`"
    assert COMMITTED.read_text(encoding="utf-8") == crd_yaml(), (
        "crds/ drifted from mooncake_operator.api: run `mooncake-operator crd --output-dir crds` and commit"
    )


def test_crd_command_writes_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd", "--output-dir", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / CRD_FILENAME).read_text(encoding="utf-8") == crd_yaml()
    assert "deprecated" not in capsys.readouterr().err
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == crd_yaml()


def test_crd_output_takes_a_format_like_kubectl(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd", "-o", "yaml"]) == 0
    assert capsys.readouterr().out == crd_yaml()
    assert main(["crd", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == yaml.safe_load(crd_yaml())


def test_output_takes_only_a_format_and_not_with_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as usage:
        main(["crd", "--output", str(tmp_path / "old")])
    assert usage.value.code == 3
    assert "invalid choice" in capsys.readouterr().err
    assert not (tmp_path / "old").exists()
    with pytest.raises(SystemExit):
        main(["crd", "-o", "xml", "--output-dir", str(tmp_path / "x")])
    assert "invalid choice: 'xml'" in capsys.readouterr().err
    assert main(["crd", "-o", "json", "--output-dir", str(tmp_path / "x")]) == 3
    assert "not both" in capsys.readouterr().err


def test_crd_is_one_plain_yaml_document() -> None:
    documents = list(yaml.safe_load_all(COMMITTED.read_text(encoding="utf-8")))
    assert len(documents) == 1
    assert documents[0] == custom_resource_definition()
    # Shared enum lists once came out as anchors and aliases (&id001 / *id001): spelled out instead.
    events = list(yaml.parse(COMMITTED.read_text(encoding="utf-8")))
    assert not [event for event in events if isinstance(event, yaml.AliasEvent)]
    assert not [event for event in events if getattr(event, "anchor", None)]


def test_names_versions_subresources_and_columns() -> None:
    crd = custom_resource_definition()
    assert crd["metadata"]["name"] == "mooncakeservings.serving.mooncake-operator.dev"
    names = crd["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == (
        "MooncakeServing",
        "mooncakeservings",
        ["mcs"],
    )
    (version,) = crd["spec"]["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {
        "status": {},
        # kubectl scale, HPA and KEDA: spec.replicas, the observed count, the replica pods' selector
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas.desired",
            "labelSelectorPath": ".status.selector",
        },
    }
    columns = {column["name"]: column["jsonPath"] for column in version["additionalPrinterColumns"]}
    assert columns == {
        "Model": ".spec.model.name",
        "Ready-Replicas": ".status.replicas.ready",
        "Desired": ".status.replicas.desired",
        "Phase": ".status.phase",
        "Canary": ".status.canary.verdict",
        "ExtHit": ".status.canary.externalHitTokens",
        "Serving": ".status.traffic.serving",
        "Candidate": ".status.rollout.candidatePhase",
        "Ready": '.status.conditions[?(@.type=="Ready")].status',
        "Age": ".metadata.creationTimestamp",
    }


def test_every_printer_column_reads_a_field_of_the_models_with_its_type() -> None:
    """A column whose jsonPath names no field (a rename in the models) would print empty forever."""
    (version,) = custom_resource_definition()["spec"]["versions"]
    fields = dict(walk(version["schema"]["openAPIV3Schema"]))
    for column in version["additionalPrinterColumns"]:
        path = column["jsonPath"]
        if path.startswith(".metadata."):
            continue
        plain = path.split("[?", 1)[0]  # a filtered list: the list itself must exist
        assert plain in fields, f"{column['name']}: {path} is not a field of the CRD's schema"
        if "[?" not in path:
            assert fields[plain].get("type") == column["type"], column


def walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = [(path, node)]
    for name, child in node.get("properties", {}).items():
        found += walk(child, f"{path}.{name}")
    if isinstance(node.get("additionalProperties"), dict):
        found += walk(node["additionalProperties"], f"{path}.*")
    if "items" in node:
        found += walk(node["items"], f"{path}[]")
    return found


def test_schema_is_structural() -> None:
    for path, node in walk(openapi_schema()):
        assert not FORBIDDEN & node.keys(), f"{path}: {FORBIDDEN & node.keys()}"
        typed = "type" in node or node.get("x-kubernetes-int-or-string") or path == ".metadata"
        assert typed, f"{path} has no type"
        assert not ("properties" in node and "additionalProperties" in node), path
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, path
        # kube-apiserver 1.20 turns an empty-string default into null and rejects the CRD.
        assert node.get("default", 0) not in (None, ""), f"{path}: default {node.get('default')!r}"


def test_free_form_fields_preserve_unknown_fields_and_quantities_are_int_or_string() -> None:
    schema = openapi_schema()["properties"]["spec"]["properties"]
    canary = schema["canary"]["properties"]
    assert canary["request"]["x-kubernetes-preserve-unknown-fields"] is True
    assert canary["expectations"]["items"]["x-kubernetes-preserve-unknown-fields"] is True
    assert canary["expectations"]["items"]["required"] == ["kind"]
    requests = schema["engine"]["properties"]["resources"]["properties"]["requests"]
    assert requests["additionalProperties"] == {"x-kubernetes-int-or-string": True}
    assert schema["speculative"]["nullable"] is True


@pytest.mark.parametrize(
    "text", ["80GB", "4gb", "512 MB", "1.5KB", "100", "80GiB", "eighty", "1e3", "-1GB", ""]
)
def test_store_size_pattern_agrees_with_the_parser(text: str) -> None:
    try:
        parse_store_size(text)
        parses = True
    except ValueError:
        parses = False
    assert bool(re.search(STORE_SIZE_PATTERN, text)) == parses


def as_json_schema(node: dict[str, Any]) -> dict[str, Any]:
    """An OpenAPI v3 structural schema as draft-4 JSON schema, to validate objects offline."""
    out: dict[str, Any] = {
        k: v for k, v in node.items() if k not in ("nullable", "default") and not k.startswith("x-")
    }
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if node.get("nullable"):
        out["type"] = [*([out["type"]] if isinstance(out.get("type"), str) else out.get("type", [])), "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    if "properties" in node:
        out["properties"] = {name: as_json_schema(child) for name, child in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False  # the API server prunes these; here they are an error
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = as_json_schema(node["additionalProperties"])
    if "items" in node:
        out["items"] = as_json_schema(node["items"])
    return out


def validator() -> jsonschema.Draft4Validator:
    schema = as_json_schema(openapi_schema())
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft4Validator(schema)


def test_the_example_and_its_wire_form_validate_against_the_schema() -> None:
    example = yaml.safe_load(reference_deployment_yaml())
    validator().validate(example)
    validator().validate(parse_resource(example).to_wire())


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("engine.tensorParallelSize", 0),
        ("engine.blockSize", "16"),
        ("store.globalSegmentSize", "80GiB"),
        ("store.protocol", "udp"),
        ("canary.onFailure", "Ignore"),
        ("speculative.method", "ngram"),
        ("replicas", -1),
    ],
)
def test_the_schema_rejects_what_the_models_reject_field_by_field(path: str, value: Any) -> None:
    obj = copy.deepcopy(yaml.safe_load(reference_deployment_yaml()))
    *parents, leaf = path.split(".")
    node = obj["spec"]
    for part in parents:
        node = node[part]
    node[leaf] = value
    assert list(validator().iter_errors(obj)), f"schema accepted spec.{path}={value!r}"
    with pytest.raises(InvalidResourceError):
        parse_resource(obj)


def test_status_written_by_the_operator_validates() -> None:
    status = MooncakeServingStatus(
        phase="Ready",
        observed_generation=2,
        conditions=[
            Condition(
                type="Ready",
                status="True",
                reason="CanaryPassed",
                last_transition_time="2026-01-01T00:00:00Z",
            )
        ],
        replicas=ReplicaCounts(desired=2, ready=2),
        canary=CanaryStatus(
            run_id="r1",
            verdict="Passed",
            external_hit_tokens=128,
            pairs=[PairEvidence(writer="a", reader="b", verdict="Passed", external_hit_tokens=128)],
        ),
    )
    obj = yaml.safe_load(reference_deployment_yaml())
    obj["status"] = status.to_wire()
    validator().validate(obj)


@pytest.mark.parametrize("version", ["1.25.0", "1.37.0"])
def test_crd_object_is_a_valid_apiextensions_v1_crd(version: str) -> None:
    kubernetes_validate.validate(custom_resource_definition(), version, strict=True)
