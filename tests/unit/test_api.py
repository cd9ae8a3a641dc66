"""The MooncakeServing models: wire format, defaults, and every validation rule with its message."""

from __future__ import annotations

import re
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import yaml
from tests.support.manifests import with_change as with_field

from mooncake_operator.api.crd import openapi_schema
from mooncake_operator.api.examples import reference_deployment, reference_deployment_yaml
from mooncake_operator.api.quantities import parse_quantity, parse_store_size
from mooncake_operator.api.resource import InvalidResourceError, MooncakeServing, parse_resource
from mooncake_operator.api.status import MooncakeServingStatus

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def example() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(reference_deployment_yaml())
    return loaded


def with_change(path: str, value: Any) -> dict[str, Any]:
    """The example with one field (dotted wire path) set; value None deletes it."""
    return with_field(example(), path, value)


def problems_of(obj: dict[str, Any]) -> list[str]:
    with pytest.raises(InvalidResourceError) as caught:
        parse_resource(obj)
    return caught.value.problems


def test_committed_example_is_the_packaged_one() -> None:
    committed = (REPO / "examples" / "minimax-m2.5-eagle3.yaml").read_text(encoding="utf-8")
    assert committed == reference_deployment_yaml(), (
        "examples/minimax-m2.5-eagle3.yaml drifted from operator/mooncake_operator/data/: "
        "copy one onto the other"
    )


def test_customer_example_parses_to_the_customers_settings() -> None:
    resource = reference_deployment()
    spec = resource.spec
    assert resource.metadata.name == "minimax-m25"
    assert spec.model.name == "MiniMaxAI/MiniMax-M2.5"
    assert spec.engine.tensor_parallel_size == 4
    assert spec.engine.block_size == 16
    assert spec.speculative is not None and spec.speculative.model == "thoughtworks/MiniMax-M2.5-Eagle3"
    assert spec.store.segment_bytes() == 80 * 1024**3
    assert spec.store.local_buffer_bytes() == 4 * 1024**3
    assert spec.canary.request is None  # the customer's request


def test_wire_form_round_trips_in_camel_case() -> None:
    resource = reference_deployment()
    wire = resource.to_wire()
    assert wire["spec"]["engine"]["tensorParallelSize"] == 4
    assert wire["spec"]["store"]["master"]["rpcPort"] == 50051
    assert MooncakeServing.model_validate(wire) == resource


def test_models_are_frozen() -> None:
    spec = reference_deployment().spec
    with pytest.raises(ValueError, match="frozen"):
        spec.replicas = 3  # type: ignore[misc]


def test_minimal_resource_gets_documented_defaults() -> None:
    resource = parse_resource(
        {
            "apiVersion": "serving.mooncake-operator.dev/v1alpha1",
            "kind": "MooncakeServing",
            "metadata": {"name": "small"},
            "spec": {
                "model": {"name": "org/model"},
                "engine": {"image": "engine:1"},
                "store": {"globalSegmentSize": "8GB"},
            },
        }
    )
    spec = resource.spec
    assert resource.metadata.namespace == "default"
    assert (spec.replicas, spec.engine.port, spec.engine.block_size, spec.engine.python_hash_seed) == (
        2,
        8000,
        16,
        0,
    )
    assert (spec.store.protocol, spec.store.local_buffer_size, spec.store.load_async) == ("tcp", "4GB", True)
    assert (spec.store.master.rpc_port, spec.store.master.metrics_port) == (50051, 9003)
    assert (spec.canary.enabled, spec.canary.pairs, spec.canary.on_failure) == (True, "ring", "Hold")
    assert spec.speculative is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GB", 80 * 1024**3), ("4gb", 4 * 1024**3), ("512MB", 512 * 1024**2), ("1.5 KB", 1536), ("100", 100)],
)
def test_store_sizes_parse_as_mooncake_reads_them(text: str, expected: int) -> None:
    assert parse_store_size(text) == expected


@pytest.mark.parametrize("text", ["80GiB", "eighty", "", "-1GB", "80 G", "1e3"])
def test_unparseable_store_sizes_are_rejected(text: str) -> None:
    with pytest.raises(ValueError, match="cannot parse size"):
        parse_store_size(text)


@pytest.mark.parametrize(("text", "expected"), [("64Gi", 64 * 2**30), ("500m", 0.5), ("4", 4), ("1e3", 1000)])
def test_quantities(text: str, expected: float) -> None:
    assert parse_quantity(text) == expected


# One invalid field at a time: (wire path, value, text the message must contain).
INVALID = [
    ("spec.store.globalSegmentSize", "80GiB", "spec.store.globalSegmentSize: cannot parse size '80GiB'"),
    ("spec.store.localBufferSize", "lots", "cannot parse size 'lots'"),
    ("spec.store.globalSegmentSize", None, "store.mode embedded needs store.globalSegmentSize > 0"),
    ("spec.store.globalSegmentSize", "0GB", "store.mode embedded needs store.globalSegmentSize > 0"),
    ("spec.store.localBufferSize", "0", "store.localBufferSize must be greater than zero"),
    ("spec.store.protocol", "rdma", "store.protocol rdma needs store.deviceName"),
    ("spec.store.protocol", "udp", "spec.store.protocol: Input should be 'tcp' or 'rdma'"),
    ("spec.store.mode", "standalone-store", "spec.store.mode: Input should be 'embedded'"),
    ("spec.speculative.model", None, "missing: speculative.model"),
    ("spec.speculative.revision", None, "missing: speculative.revision"),
    ("spec.speculative.method", "ngram", "spec.speculative.method: Input should be 'eagle3'"),
    (
        "spec.engine.tensorParallelSize",
        0,
        "spec.engine.tensorParallelSize: Input should be greater than or equal to 1",
    ),
    ("spec.engine.blockSize", -16, "spec.engine.blockSize: Input should be greater than or equal to 1"),
    ("spec.replicas", 1, "replicas is 1 but the canary needs at least 2 replicas"),
    (
        "spec.engine.extraArgs",
        ["--block-size=32"],
        "must not contain --block-size: it is set from engine.blockSize",
    ),
    ("spec.engine.extraArgs", ["--speculative-config", "{}"], "must not contain --speculative-config"),
    ("spec.engine.extraEnv", [{"name": "PYTHONHASHSEED", "value": "1"}], "must not set PYTHONHASHSEED"),
    ("spec.engine.resources", {"limits": {"nvidia.com/gpu": 8}}, "must not set nvidia.com/gpu"),
    ("spec.engine.resources", {"requests": {"memory": "lots"}}, "cannot parse quantity 'lots'"),
    ("spec.model.cache", {"ephemeralSize": "-1Gi"}, "quantity '-1Gi' must not be negative"),
    (
        "spec.engine.tensorParalelSize",
        4,
        "spec.engine.tensorParalelSize: unknown field; did you mean 'tensorParallelSize'?",
    ),
    ("spec.engine.image", "Not A Valid Ref!!", "spec.engine.image: image 'Not A Valid Ref!!' contains"),
    ("spec.engine.image", "team/VLLM:1", "(the repository must be lowercase)"),
    ("spec.store.master.image", "m@sha256:abc", "spec.store.master.image: image 'm@sha256:abc' is not"),
    ("spec.pod.scratchSise", "1Gi", "spec.pod.scratchSise: unknown field; did you mean 'scratchSize'?"),
    ("spec.pod.zzz", 1, "spec.pod.zzz: unknown field (known fields: automountServiceAccountToken,"),
    ("spec.engine.image", None, "spec.engine.image: Field required"),
    ("spec.model.cache", {"existingClaim": "hf", "ephemeralSize": "1Ti"}, "set either existingClaim"),
    ("spec.model.hfToken", "hf_secret", "spec.model.hfToken: unknown field; did you mean 'hfTokenSecretRef'"),
    ("spec.store.master.metricsPort", 50051, "rpcPort and metricsPort must differ"),
    ("spec.canary.onFailure", "Ignore", "Input should be 'Hold' or 'Rollback'"),
    ("spec.canary.pairs", "all", "Input should be 'ring' or 'first'"),
    ("metadata.name", "MiniMax", "metadata.name: String should match pattern"),
    ("metadata.name", "m" * 41, "metadata.name: String should have at most 40 characters"),
    ("apiVersion", "serving.mooncake-operator.dev/v1", "apiVersion: Input should be"),
]


@pytest.mark.parametrize(
    ("path", "value", "message"), INVALID, ids=[f"{p}={v!r}"[:60] for p, v, _ in INVALID]
)
def test_each_invalid_field_is_rejected_with_a_clear_message(path: str, value: Any, message: str) -> None:
    problems = problems_of(with_change(path, value))
    assert any(message in problem for problem in problems), problems


def test_canary_expectations_are_kinded_free_form_checks() -> None:
    checks = [{"kind": "json_object_only"}, {"kind": "json_values_include", "values": ["us-west", 4, 16]}]
    resource = parse_resource(with_change("spec.canary.expectations", checks))
    assert resource.spec.canary.expectations is not None
    assert resource.to_wire()["spec"]["canary"]["expectations"] == checks
    assert parse_resource(with_change("spec.canary.expectations", [])).spec.canary.expectations == []
    problems = problems_of(with_change("spec.canary.expectations", [{"values": [1]}]))
    assert any("spec.canary.expectations.0.kind: Field required" in p for p in problems), problems


def test_canary_request_is_free_form() -> None:
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    assert parse_resource(with_change("spec.canary.request", request)).spec.canary.request == request


def test_replicas_one_is_fine_without_the_canary() -> None:
    obj = with_change("spec.replicas", 1)
    obj["spec"]["canary"]["enabled"] = False
    assert parse_resource(obj).spec.replicas == 1


def test_rdma_with_a_device_is_accepted() -> None:
    obj = with_change("spec.store.protocol", "rdma")
    obj["spec"]["store"]["deviceName"] = "mlx5_0"
    obj["spec"]["store"]["rdma"] = {"resourceName": "rdma/ib"}
    assert parse_resource(obj).spec.store.device_name == "mlx5_0"


def test_every_problem_is_reported_at_once() -> None:
    obj = with_change("spec.engine.tensorParallelSize", 0)
    obj["spec"]["store"]["localBufferSize"] = "lots"
    problems = problems_of(obj)
    assert len(problems) == 2, problems
    assert "invalid MooncakeServing" in str(InvalidResourceError(problems))


def test_read_only_mappings_are_accepted() -> None:
    assert parse_resource(MappingProxyType(example())) == reference_deployment()


def test_status_models_carry_canary_evidence() -> None:
    status = MooncakeServingStatus.model_validate(
        {
            "phase": "CanaryFailed",
            "observedGeneration": 3,
            "conditions": [
                {
                    "type": "CanaryPassed",
                    "status": "False",
                    "reason": "OutputMismatch",
                    "message": "replica-1 answered differently from replica-0",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                    "observedGeneration": 3,
                }
            ],
            "replicas": {"desired": 2, "ready": 2},
            "canary": {
                "runId": "r1",
                "verdict": "Failed",
                "externalHitTokens": 128,
                "pairs": [
                    {
                        "writer": "minimax-m25-replica-0",
                        "reader": "minimax-m25-replica-1",
                        "verdict": "Failed",
                        "externalHitTokens": 128,
                        "coldLatencyMs": 812.5,
                        "warmLatencyMs": 301.0,
                        "firstMismatch": {"position": 12, "cold": "us-west", "warm": "us-east"},
                    }
                ],
            },
            "lastGoodRevision": "abc123",
        }
    )
    assert status.canary is not None and status.canary.pairs[0].first_mismatch is not None
    assert status.to_wire()["canary"]["pairs"][0]["coldLatencyMs"] == 812.5
    with pytest.raises(ValueError, match="phase"):
        MooncakeServingStatus.model_validate({"phase": "Running"})


def wire_field_paths(schema: dict[str, Any], path: str = "") -> list[str]:
    paths = []
    for name, child in schema.get("properties", {}).items():
        here = f"{path}.{name}" if path else name
        paths.append(here)
        paths += wire_field_paths(child.get("items", child), here)
    return paths


def test_the_configuration_reference_documents_every_field() -> None:
    doc = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    schema = openapi_schema()["properties"]
    missing = [
        path
        for section in ("spec", "status")
        for path in wire_field_paths(schema[section])
        if not re.search(rf"(?<![A-Za-z]){path.rsplit('.', 1)[-1]}(?![A-Za-z])", doc)
    ]
    assert not missing, f"docs/api.md does not mention: {missing}"
