"""The pure renderer: golden manifests, offline schema validation, and the properties each child must have.

Golden files of whole renders live in tests/unit/golden/, those of each builder module in
tests/unit/builders/golden/ (tests/unit/builders/test_build_<module>.py). After an intended change,
regenerate them with
    MOONCAKE_OPERATOR_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_render.py tests/unit/builders
and review the diff before committing.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from tests.unit.builders.cases import CASES, OWNER_UID, example_dict, small_variant
from tests.unit.customer_seed import CUSTOMER_ARGV, CUSTOMER_ENV, CUSTOMER_STORE_JSON

from mooncake_operator.api.examples import reference_deployment, reference_deployment_yaml
from mooncake_operator.api.quantities import format_bytes
from mooncake_operator.api.resource import MooncakeServing, parse_resource
from mooncake_operator.build.digests import spec_hash
from mooncake_operator.build.engine_args import kv_fingerprint, replica_launch
from mooncake_operator.build.manifests import render_all, to_yaml_stream
from mooncake_operator.build.master import master_deployment
from mooncake_operator.build.names import (
    CONFIG_HASH_ANNOTATION,
    REPLICA_SET_LABEL,
    TEMPLATE_ANNOTATION,
    TRAFFIC_LABEL,
    TRAFFIC_OFF,
    TRAFFIC_ON,
    replica_pod_names,
    replica_set_name,
    replica_urls,
)
from mooncake_operator.build.replicas import ReplicaTemplate, replica_stateful_set, replica_template_id
from mooncake_operator.build.services import client_service, headless_service
from mooncake_operator.build.store_config import master_address, store_config_map
from mooncake_operator.cli.main import main

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("MOONCAKE_OPERATOR_UPDATE_GOLDEN") == "1"

# The oldest and newest Kubernetes schemas kubernetes-validate ships (offline, in the package).
KUBERNETES_VERSIONS = ("1.25.0", "1.37.0")


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_manifests_match_the_golden_file(case: str) -> None:
    rendered = to_yaml_stream(render_all(CASES[case](), owner_uid=OWNER_UID))
    path = GOLDEN / f"{case}.yaml"
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(rendered, encoding="utf-8")
    assert path.exists(), f"{path} is missing: run with MOONCAKE_OPERATOR_UPDATE_GOLDEN=1 to create it"
    assert rendered == path.read_text(encoding="utf-8"), (
        f"{path.name} differs from the renderer's output; if the change is intended, "
        "rerun with MOONCAKE_OPERATOR_UPDATE_GOLDEN=1 and review the diff"
    )


def all_manifests() -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{case}/{manifest['kind']}/{manifest['metadata']['name']}", manifest)
        for case, build in sorted(CASES.items())
        for manifest in render_all(build(), owner_uid=OWNER_UID)
    ]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(("label", "manifest"), all_manifests(), ids=[label for label, _ in all_manifests()])
def test_every_rendered_object_is_valid_kubernetes(
    label: str, manifest: dict[str, Any], version: str
) -> None:
    kubernetes_validate.validate(manifest, version, strict=True)


def test_offline_validation_does_catch_a_bad_manifest() -> None:
    stateful_set = replica_stateful_set(reference_deployment(), owner_uid=OWNER_UID)
    stateful_set["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(stateful_set, KUBERNETES_VERSIONS[-1], strict=True)


def test_children_in_apply_order_with_stable_names() -> None:
    kinds_and_names = [
        (m["kind"], m["metadata"]["name"]) for m in render_all(reference_deployment(), owner_uid="u")
    ]
    assert kinds_and_names == [
        ("NetworkPolicy", "minimax-m25-master"),
        ("NetworkPolicy", "minimax-m25-replica"),
        ("ConfigMap", "minimax-m25-store-config"),
        ("Service", "minimax-m25-master"),
        ("Deployment", "minimax-m25-master"),
        ("Service", "minimax-m25-replicas"),
        ("StatefulSet", "minimax-m25-replica"),
        ("Service", "minimax-m25"),
        ("PodDisruptionBudget", "minimax-m25-replica"),
    ]


def test_every_child_is_owned_labelled_and_namespaced() -> None:
    resource = reference_deployment()
    for manifest in render_all(resource, owner_uid=OWNER_UID):
        meta = manifest["metadata"]
        assert meta["namespace"] == "default"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "serving.mooncake-operator.dev/v1alpha1",
                "kind": "MooncakeServing",
                "name": "minimax-m25",
                "uid": OWNER_UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        for key in ("name", "instance", "component", "managed-by", "part-of"):
            assert meta["labels"][f"app.kubernetes.io/{key}"], (manifest["kind"], key)
        assert meta["labels"]["app.kubernetes.io/instance"] == "minimax-m25"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "mooncake-operator"


def test_without_an_owner_uid_there_is_no_owner_reference() -> None:
    for manifest in render_all(reference_deployment(), owner_uid=None):
        assert "ownerReferences" not in manifest["metadata"]


def replica_container(resource: MooncakeServing) -> dict[str, Any]:
    stateful_set = replica_stateful_set(resource, owner_uid=OWNER_UID)
    container: dict[str, Any] = stateful_set["spec"]["template"]["spec"]["containers"][0]
    return container


def test_replica_command_is_the_customers_argv_item_by_item() -> None:
    # The additions: the store key namespace of the KV fingerprint (spec.store.isolateRevisions), the
    # store's load-failure policy, the flags that give each answer the canary's per-request evidence,
    # and the engine's own drain on SIGTERM.
    resource = reference_deployment()
    command = replica_container(resource)["command"]
    kv_at = CUSTOMER_ARGV.index("--kv-transfer-config") + 1
    kv = json.loads(CUSTOMER_ARGV[kv_at])
    kv["kv_connector_extra_config"]["cache_prefix"] = kv_fingerprint(resource.spec)
    kv["kv_load_failure_policy"] = "fail"  # vLLM's default, rendered explicitly
    expected = [*CUSTOMER_ARGV[:kv_at], json.dumps(kv, separators=(",", ":")), *CUSTOMER_ARGV[kv_at + 1 :]]
    evidence = ["--enable-prompt-tokens-details", "--per-request-spec-decode-metrics", "summary"]
    drain = ["--shutdown-timeout", "20"]  # in-flight requests finish on SIGTERM; the store unmounts cleanly
    assert command == [*expected, *evidence, *drain, "--host", "0.0.0.0", "--port", "8000"]


def test_replica_command_comes_from_engine_args() -> None:
    resource = small_variant()
    launch = replica_launch(resource.spec, master_address=master_address(resource), port=8080)
    assert replica_container(resource)["command"] == list(launch.argv)


def test_store_config_map_is_the_customers_json_with_the_master_service_address() -> None:
    config_map = store_config_map(reference_deployment(), owner_uid=OWNER_UID)
    text = config_map["data"]["mooncake_store.json"]
    ours, theirs = json.loads(text), json.loads(CUSTOMER_STORE_JSON)
    assert list(ours) == list(theirs)
    for key in theirs:
        expected = "minimax-m25-master.default.svc:50051" if key == "master_server_address" else theirs[key]
        assert ours[key] == expected, key


def test_replica_env_mounts_and_secret() -> None:
    container = replica_container(reference_deployment())
    env = {item["name"]: item for item in container["env"]}
    for name, value in CUSTOMER_ENV.items():
        assert env[name] == {"name": name, "value": value}
    # The token is a file (HF_TOKEN_PATH), never an environment variable.
    assert "HF_TOKEN" not in env
    assert env["HF_TOKEN_PATH"] == {"name": "HF_TOKEN_PATH", "value": "/etc/mooncake/hf-token/token"}
    volumes = {
        v["name"]: v
        for v in replica_stateful_set(reference_deployment(), owner_uid=None)["spec"]["template"]["spec"][
            "volumes"
        ]
    }
    assert volumes["hf-token"]["secret"] == {
        "secretName": "hf-token",
        "items": [{"key": "token", "path": "token"}],
    }
    assert not any("valueFrom" in item and "secretKeyRef" in item["valueFrom"] for item in container["env"])
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    assert mounts["/etc/mooncake/hf-token"] == "hf-token"
    assert mounts["/etc/vllm"] == "store-config"
    assert mounts["/dev/shm"] == "dshm"
    assert mounts[env["HF_HOME"]["value"]] == "hf-cache"
    assert not any("value" in item and item["value"].startswith("hf_") for item in container["env"])


def test_volumes_shm_is_memory_backed_and_cache_is_ephemeral_or_a_claim() -> None:
    def volumes(resource: MooncakeServing) -> dict[str, dict[str, Any]]:
        stateful_set = replica_stateful_set(resource, owner_uid=OWNER_UID)
        return {v["name"]: v for v in stateful_set["spec"]["template"]["spec"]["volumes"]}

    example = volumes(reference_deployment())
    assert example["dshm"]["emptyDir"] == {"medium": "Memory"}
    assert "hf-cache" not in example  # the example's claim template provides it
    assert example["store-config"]["configMap"] == {"name": "minimax-m25-store-config"}
    obj = example_dict()
    obj["spec"]["model"]["cache"] = {"ephemeralSize": "600Gi"}
    assert volumes(parse_resource(obj))["hf-cache"]["emptyDir"] == {"sizeLimit": "600Gi"}
    variant = volumes(small_variant())
    assert variant["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert variant["hf-cache"]["persistentVolumeClaim"] == {"claimName": "hf-cache"}


def test_gpus_equal_tensor_parallel_size_and_memory_adds_the_store() -> None:
    resources = replica_container(reference_deployment())["resources"]
    # 4 tensor-parallel workers, each mounting an 80GB segment and a 4GB local buffer.
    store = 4 * (80 + 4)
    assert resources["requests"] == {
        "cpu": "16",
        "memory": f"{128 + store}Gi",
        "nvidia.com/gpu": "4",
        "ephemeral-storage": "10Gi",  # the /tmp scratch (pod.scratchSize's default)
    }
    assert resources["limits"] == {"memory": f"{192 + store}Gi", "nvidia.com/gpu": "4"}
    obj = example_dict()
    obj["spec"]["model"]["cache"] = {"ephemeralSize": "600Gi"}
    ephemeral = replica_container(parse_resource(obj))["resources"]
    assert ephemeral["requests"]["ephemeral-storage"] == "610Gi"  # the emptyDir cache and the scratch


def test_the_scratch_volume_is_sized_and_requested() -> None:
    """/tmp (vLLM's compile caches) is an emptyDir on the node's disk: without a sizeLimit and a request
    the scheduler ignores it and the kubelet may evict a serving replica for it."""

    def template(obj: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        spec = replica_stateful_set(parse_resource(obj), owner_uid=OWNER_UID)["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        engine = next(c for c in spec["containers"] if c["name"] == "vllm")
        return volumes["tmp"], engine["resources"]

    tmp, resources = template(example_dict())
    assert tmp["emptyDir"] == {"sizeLimit": "10Gi"}
    assert resources["requests"]["ephemeral-storage"] == "10Gi"
    obj = example_dict()
    obj["spec"]["pod"] = {"scratchSize": "32Gi"}
    obj["spec"]["engine"]["resources"]["requests"]["ephemeral-storage"] = "1Gi"
    obj["spec"]["engine"]["resources"]["limits"]["ephemeral-storage"] = "2Gi"
    tmp, resources = template(obj)
    assert tmp["emptyDir"] == {"sizeLimit": "32Gi"}
    # Added to what the user requests for the container's own writes (and to a limit when one is set).
    assert resources["requests"]["ephemeral-storage"] == "33Gi"
    assert resources["limits"]["ephemeral-storage"] == "34Gi"


@pytest.mark.parametrize(
    ("size", "problem"),
    [("512Mi", "at least 1Gi"), ("ten gigs", "quantity"), ("-1Gi", "quantity")],
)
def test_a_scratch_size_that_cannot_hold_the_caches_is_refused(size: str, problem: str) -> None:
    obj = example_dict()
    obj["spec"]["pod"] = {"scratchSize": size}
    with pytest.raises(ValueError, match=problem):
        parse_resource(obj)


def test_memory_request_without_a_user_request_is_the_store_alone() -> None:
    resources = replica_container(small_variant())["resources"]
    assert resources["requests"]["memory"] == "640Mi"  # 1 worker * (512MB + 128MB)
    assert "memory" not in resources["limits"]


def test_probes_watch_health() -> None:
    container = replica_container(reference_deployment())
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600


def test_master_runs_from_the_engine_image_with_its_ports() -> None:
    deployment = master_deployment(reference_deployment(), owner_uid=OWNER_UID)
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == reference_deployment().spec.engine.image
    assert container["command"][0] == "mooncake_master"
    assert "-rpc_port=50051" in container["command"] and "-metrics_port=9003" in container["command"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"rpc": 50051, "metrics": 9003}
    assert container["readinessProbe"] and container["livenessProbe"]
    assert container["resources"]["requests"] == {"cpu": "2", "memory": "4Gi"}
    assert (
        master_deployment(small_variant(), owner_uid=None)["spec"]["template"]["spec"]["containers"][0][
            "image"
        ]
        == "master:1"
    )


def test_selectors_match_the_pods_they_are_for() -> None:
    resource = reference_deployment()
    by_name = {(m["kind"], m["metadata"]["name"]): m for m in render_all(resource, owner_uid=OWNER_UID)}
    stateful_set = by_name[("StatefulSet", "minimax-m25-replica")]
    pod_labels = stateful_set["spec"]["template"]["metadata"]["labels"]
    master = by_name[("Deployment", "minimax-m25-master")]
    master_pod_labels = master["spec"]["template"]["metadata"]["labels"]

    def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
        return all(labels.get(key) == value for key, value in selector.items())

    assert selects(stateful_set["spec"]["selector"]["matchLabels"], pod_labels)
    assert selects(by_name[("Service", "minimax-m25-replicas")]["spec"]["selector"], pod_labels)
    proven = {**pod_labels, TRAFFIC_LABEL: TRAFFIC_ON}  # what the operator sets once proven
    assert selects(by_name[("Service", "minimax-m25")]["spec"]["selector"], proven)
    assert selects(by_name[("Service", "minimax-m25-master")]["spec"]["selector"], master_pod_labels)
    assert not selects(by_name[("Service", "minimax-m25-master")]["spec"]["selector"], pod_labels)
    assert stateful_set["spec"]["serviceName"] == "minimax-m25-replicas"
    assert by_name[("Service", "minimax-m25-replicas")]["spec"]["clusterIP"] == "None"


def test_replica_pods_start_out_of_the_client_service_and_the_label_alone_decides() -> None:
    resource = reference_deployment()
    pod_labels = replica_stateful_set(resource, owner_uid=None)["spec"]["template"]["metadata"]["labels"]
    assert pod_labels[TRAFFIC_LABEL] == TRAFFIC_OFF  # off until a canary proves the pod
    off = pod_labels
    on = {**pod_labels, TRAFFIC_LABEL: TRAFFIC_ON}
    client = client_service(resource, owner_uid=None)["spec"]["selector"]
    headless = headless_service(resource, owner_uid=None)["spec"]["selector"]
    stateful_set = replica_stateful_set(resource, owner_uid=None)["spec"]["selector"]["matchLabels"]
    assert not all(off.get(k) == v for k, v in client.items())  # out of user traffic
    assert all(off.get(k) == v for k, v in headless.items())  # still reachable by the canary
    assert all(off.get(k) == v for k, v in stateful_set.items())  # still owned by its StatefulSet
    assert all(on.get(k) == v for k, v in client.items())  # proven: in user traffic
    assert all(on.get(k) == v for k, v in stateful_set.items())  # the label never changes ownership


def with_spec(change: dict[str, Any]) -> MooncakeServing:
    obj = example_dict()
    for dotted, value in change.items():
        *parents, leaf = dotted.split(".")
        node = obj["spec"]
        for part in parents:
            node = node[part]
        node[leaf] = value
    return parse_resource(obj)


def template_annotations(resource: MooncakeServing) -> dict[str, str]:
    annotations: dict[str, str] = replica_stateful_set(resource, owner_uid=None)["spec"]["template"][
        "metadata"
    ]["annotations"]
    return annotations


def test_a_store_config_change_changes_the_pod_template_hash() -> None:
    base = template_annotations(reference_deployment())[CONFIG_HASH_ANNOTATION]
    assert template_annotations(reference_deployment())[CONFIG_HASH_ANNOTATION] == base
    for change in (
        {"store.globalSegmentSize": "40GB"},
        {"store.enableOffload": True},
        {"store.master.rpcPort": 50052},
    ):
        assert template_annotations(with_spec(change))[CONFIG_HASH_ANNOTATION] != base, change
    assert template_annotations(with_spec({"replicas": 3}))[CONFIG_HASH_ANNOTATION] == base


def test_replica_urls_address_every_pod_through_the_headless_service() -> None:
    resource = with_spec({"replicas": 3})
    assert replica_pod_names(resource) == [f"minimax-m25-replica-{i}" for i in range(3)]
    assert replica_urls(resource) == [
        f"http://minimax-m25-replica-{i}.minimax-m25-replicas.default.svc:8000" for i in range(3)
    ]


def test_builders_are_pure_and_return_fresh_objects() -> None:
    resource = reference_deployment()
    first = render_all(resource, owner_uid=OWNER_UID)
    snapshot = copy.deepcopy(first)
    kinds = [manifest["kind"] for manifest in first]
    stateful_set, deployment = first[kinds.index("StatefulSet")], first[kinds.index("Deployment")]
    stateful_set["spec"]["template"]["metadata"]["labels"]["mutated"] = "yes"
    deployment["metadata"]["labels"]["mutated"] = "yes"
    assert render_all(resource, owner_uid=OWNER_UID) == snapshot
    assert "mutated" not in deployment["spec"]["template"]["metadata"]["labels"]


def test_spec_hash_is_stable_and_sensitive() -> None:
    spec = reference_deployment().spec
    assert spec_hash(spec) == spec_hash(reference_deployment().spec)
    assert spec_hash(with_spec({"engine.blockSize": 32}).spec) != spec_hash(spec)


def test_format_bytes() -> None:
    assert format_bytes(344 * 2**30) == "344Gi"
    assert format_bytes(1536 * 2**20) == "1536Mi"
    assert format_bytes(100) == "100"
    assert format_bytes(0) == "0"


# --- the command ----------------------------------------------------------------------------------------


def test_render_command_prints_the_stream(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["render", "-f", str(Path(__file__).parents[2] / "examples" / "minimax-m2.5-eagle3.yaml")]) == 0
    )
    out = capsys.readouterr().out
    assert out == to_yaml_stream(render_all(reference_deployment(), owner_uid=None))
    assert [doc["kind"] for doc in yaml.safe_load_all(out)] == [
        "NetworkPolicy",
        "NetworkPolicy",
        "ConfigMap",
        "Service",
        "Deployment",
        "Service",
        "StatefulSet",
        "Service",
        "PodDisruptionBudget",
    ]


def test_render_command_owner_uid(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "mcs.yaml"
    path.write_text(reference_deployment_yaml(), encoding="utf-8")
    assert main(["render", "-f", str(path), "--owner-uid", OWNER_UID]) == 0
    for doc in yaml.safe_load_all(capsys.readouterr().out):
        assert doc["metadata"]["ownerReferences"][0]["uid"] == OWNER_UID


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "no MooncakeServing found"),
        ("- a\n- b\n", "expected a MooncakeServing mapping"),
        ("spec: [unclosed", "while parsing"),
        (
            reference_deployment_yaml().replace("tensorParallelSize: 4", "tensorParallelSize: 0"),
            "tensorParallelSize",
        ),
        (
            reference_deployment_yaml() + "---\n" + reference_deployment_yaml().replace("80GB", "80GiB"),
            "(document 2): spec.store.globalSegmentSize: cannot parse size '80GiB'",
        ),
    ],
)
def test_render_command_rejects_bad_input_printing_nothing(
    content: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content, encoding="utf-8")
    assert main(["render", "-f", str(path)]) == 3
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err


def test_render_command_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "-f", str(tmp_path / "absent.yaml")]) == 3
    captured = capsys.readouterr()
    assert captured.out == "" and "absent.yaml" in captured.err


# --- BlueGreen replica sets --------------------------------------------------------------------------


def _with_spec(resource: MooncakeServing, **changes: Any) -> MooncakeServing:
    return resource.model_copy(update={"spec": resource.spec.model_copy(update=changes)})


def test_a_blue_green_candidate_set_has_its_own_name_selector_and_pods() -> None:
    resource = reference_deployment()
    template = replica_template_id(resource)
    name = replica_set_name(resource, template)
    plain = replica_stateful_set(resource, owner_uid="uid-1")
    candidate = replica_stateful_set(resource, owner_uid="uid-1", replica_set=name)
    assert candidate["metadata"]["name"] == name != plain["metadata"]["name"]
    assert candidate["metadata"]["ownerReferences"] == plain["metadata"]["ownerReferences"]
    # Its selector (immutable) and pods name the set; the first set's stay as they always were.
    selector = candidate["spec"]["selector"]["matchLabels"]
    assert selector == {**plain["spec"]["selector"]["matchLabels"], REPLICA_SET_LABEL: name}
    assert REPLICA_SET_LABEL not in plain["spec"]["template"]["metadata"]["labels"]
    pod_labels = candidate["spec"]["template"]["metadata"]["labels"]
    assert pod_labels[REPLICA_SET_LABEL] == name
    assert pod_labels[TRAFFIC_LABEL] == TRAFFIC_OFF  # out of traffic until proven
    assert list(pod_labels)[-2:] == [REPLICA_SET_LABEL, TRAFFIC_LABEL]  # as rendered before
    # A pass renders the template once and passes it in: the same set.
    once = ReplicaTemplate.of(resource)
    assert replica_stateful_set(resource, owner_uid="uid-1", replica_set=name, template=once) == candidate
    # The one headless Service gives every set's pods their names; the master is shared.
    assert candidate["spec"]["serviceName"] == plain["spec"]["serviceName"]
    assert replica_pod_names(resource, name) == [f"{name}-{i}" for i in range(resource.spec.replicas)]
    assert all(f"//{name}-" in url for url in replica_urls(resource, name))
    # Both carry the template digest, computed without the set's own label.
    assert candidate["metadata"]["annotations"][TEMPLATE_ANNOTATION] == template
    assert plain["metadata"]["annotations"][TEMPLATE_ANNOTATION] == template
    manifests = render_all(resource, owner_uid="uid-1", replica_set=name)
    stateful_sets = [m["metadata"]["name"] for m in manifests if m["kind"] == "StatefulSet"]
    assert stateful_sets == [name]


def test_the_template_digest_follows_the_pod_template_only() -> None:
    resource = reference_deployment()
    template = replica_template_id(resource)
    # A replica count or canary change keeps the set; a KV-shaping change (fingerprint) or image does not.
    assert replica_template_id(_with_spec(resource, replicas=3)) == template
    canary = resource.spec.canary.model_copy(update={"interval_seconds": 600})
    assert replica_template_id(_with_spec(resource, canary=canary)) == template
    engine = resource.spec.engine.model_copy(update={"image": "registry.invalid/other:1"})
    changed = _with_spec(resource, engine=engine)
    assert replica_template_id(changed) != template
    assert kv_fingerprint(changed.spec) != kv_fingerprint(resource.spec)
