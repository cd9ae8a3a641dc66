"""The committed CRD against the real kube-apiserver (1.20): accepted, valid resources stored with the
server's defaults, invalid ones rejected by the server AND by the Python models, the status subresource
and printer columns, and every rendered child object passing a server-side dry run.

The pydantic models are the source of truth and the CRD is generated from them; these tests prove the
server and the models agree on every rule the schema can express, and name the rules only the models
enforce (1.20 has no CEL validation rules).
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.support.apiserver import ControlPlane
from tests.support.manifests import with_change

from mooncake_operator.api import crd
from mooncake_operator.api.group import API_VERSION, KIND, PLURAL, SHORT_NAMES
from mooncake_operator.api.resource import InvalidResourceError, parse_resource
from mooncake_operator.build.disruption import POLICY_V1, POLICY_V1BETA1, pod_disruption_budget
from mooncake_operator.build.manifests import render_all
from mooncake_operator.build.names import LABEL_INSTANCE
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.kube.errors import KubeApiError
from mooncake_operator.reconcile.act.children import holds

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / crd.CRD_FILENAME
EXAMPLE_PATH = REPO / "examples" / "minimax-m2.5-eagle3.yaml"
RDMA_EXAMPLE_PATH = REPO / "examples" / "minimax-m2.5-eagle3-rdma.yaml"
MANAGER = "api-server-schema-test"
CRD_API = ("apiextensions.k8s.io/v1", "CustomResourceDefinition")
ESTABLISH_TIMEOUT_S = 30.0
TABLE_ACCEPT = "application/json;as=Table;v=v1;g=meta.k8s.io"

Manifest = dict[str, Any]


def committed_crd() -> Manifest:
    loaded: Manifest = yaml.safe_load(CRD_PATH.read_text(encoding="utf-8"))
    return loaded


def customer_example(namespace: str) -> Manifest:
    """examples/minimax-m2.5-eagle3.yaml exactly as committed, moved into the test's namespace."""
    loaded: Manifest = yaml.safe_load(EXAMPLE_PATH.read_text(encoding="utf-8"))
    loaded["metadata"]["namespace"] = namespace
    return loaded


def rdma_example(namespace: str) -> Manifest:
    """examples/minimax-m2.5-eagle3-rdma.yaml as committed, moved into the test's namespace."""
    loaded: Manifest = yaml.safe_load(RDMA_EXAMPLE_PATH.read_text(encoding="utf-8"))
    loaded["metadata"]["namespace"] = namespace
    return loaded


def assert_kept(sent: Any, stored: Any, path: str) -> None:
    """Every field that was sent is stored with the same value (the server may add defaults)."""
    if isinstance(sent, dict):
        assert isinstance(stored, dict), f"{path}: sent an object, stored {stored!r}"
        for key, value in sent.items():
            assert key in stored, f"{path}.{key}: sent {value!r}, not stored"
            assert_kept(value, stored[key], f"{path}.{key}")
    else:
        assert stored == sent, f"{path}: sent {sent!r}, stored {stored!r}"


def established(found: Manifest) -> bool:
    conditions = (found.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


async def apply_committed_crd(kube: KubeClient) -> Manifest:
    """Server-side apply of crds/…yaml, then wait until the API serves the resource.

    The operator's tests apply the generated CRD (crd.custom_resource_definition()) under their own field
    manager; the committed file is the same document (checked below), so both managers co-own identical
    values and neither apply changes anything the other made.
    """
    await kube.apply(committed_crd(), field_manager=MANAGER)
    deadline = time.monotonic() + ESTABLISH_TIMEOUT_S
    while True:
        found = await kube.get(*CRD_API, crd.CRD_NAME)
        if established(found):
            return found
        if time.monotonic() > deadline:
            raise AssertionError(
                f"CRD {crd.CRD_NAME} not Established after {ESTABLISH_TIMEOUT_S}s; "
                f"conditions: {(found.get('status') or {}).get('conditions')}"
            )
        await asyncio.sleep(0.2)


@pytest.fixture
async def crd_installed(kube: KubeClient) -> AsyncIterator[Manifest]:
    yield await apply_committed_crd(kube)


async def create(kube: KubeClient, obj: Manifest) -> Manifest:
    return await kube.create(obj, field_manager=MANAGER)


async def server_rejection(kube: KubeClient, obj: Manifest) -> KubeApiError:
    """The API server's 422 for `obj`; fails if the server stores it."""
    with pytest.raises(KubeApiError) as caught:
        await create(kube, obj)
    assert caught.value.status == 422, f"expected 422 Invalid, got {caught.value}"
    return caught.value


def model_problems(obj: Manifest) -> list[str]:
    with pytest.raises(InvalidResourceError) as caught:
        parse_resource(obj)
    return caught.value.problems


# --------------------------------------------------------------------------- 1. the CRD itself


async def test_committed_crd_is_accepted_established_and_reapplying_it_changes_nothing(
    kube: KubeClient,
) -> None:
    assert committed_crd() == crd.custom_resource_definition(), (
        "crds/ drifted from the models: run `mooncake-operator crd` and scripts/sync-chart-crds"
    )
    first = await apply_committed_crd(kube)
    conditions = {c["type"]: c["status"] for c in first["status"]["conditions"]}
    assert conditions.get("NamesAccepted") == "True", conditions
    # A non-structural schema is accepted by the server but flagged; ours must be structural.
    assert "NonStructuralSchema" not in conditions, conditions
    assert first["status"]["acceptedNames"]["shortNames"] == list(SHORT_NAMES)
    assert first["status"]["acceptedNames"]["kind"] == KIND

    again = await apply_committed_crd(kube)
    assert again["metadata"]["generation"] == first["metadata"]["generation"], (
        "re-applying the same CRD changed its spec"
    )
    assert established(again)


# --------------------------------------------------------------------------- 2. the customer's example


async def test_customer_example_is_stored_as_is_with_the_servers_defaults(
    kube: KubeClient, namespace: str, crd_installed: Manifest
) -> None:
    example = customer_example(namespace)
    assert example["spec"]["store"]["deviceName"] == "", "the example should carry deviceName: ''"

    stored = await create(kube, example)

    # kube-apiserver 1.20.2 as released reads "" as null and answers 422 "spec.store.deviceName in body
    # must be of type string: null" (kube-openapi, k/k#99804); scripts/build-kube patches that. The empty
    # string must be accepted and survive the round trip.
    assert stored["spec"]["store"]["deviceName"] == ""
    assert_kept(example["spec"], stored["spec"], "spec")

    # Fields the example leaves out come back with the schema's defaults.
    assert stored["spec"]["engine"]["port"] == 8000
    assert stored["spec"]["engine"]["startupTimeoutSeconds"] == 3600
    assert stored["spec"]["store"]["master"]["rpcPort"] == 50051
    assert stored["spec"]["store"]["master"]["metricsPort"] == 9003
    assert "request" not in stored["spec"]["canary"], "an unset canary request must stay unset"

    # The operator reads what the server returns, and the server's defaults are the models' defaults.
    parsed = parse_resource(stored)
    assert parsed.spec == parse_resource(example).spec
    assert parsed.metadata.uid == stored["metadata"]["uid"]
    assert parsed.metadata.namespace == namespace

    read_back = await kube.get(API_VERSION, KIND, example["metadata"]["name"], namespace)
    assert read_back["spec"] == stored["spec"]


# --------------------------------------------------------------------------- 3. valid variants


def _no_speculative(obj: Manifest) -> Manifest:
    return with_change(obj, "spec.speculative", None)


def _rdma(obj: Manifest) -> Manifest:
    changed = with_change(with_change(obj, "spec.store.protocol", "rdma"), "spec.store.deviceName", "mlx5_0")
    return with_change(changed, "spec.store.rdma", {"resourceName": "rdma/ib"})


def _rdma_host_network(obj: Manifest) -> Manifest:
    changed = _rdma(obj)
    rdma = {"hostDevices": True, "hostNetwork": True, "memlock": "Runtime"}
    changed = with_change(changed, "spec.store.rdma", rdma)
    return with_change(changed, "spec.scheduling", {"replicaAntiAffinity": "Required"})


# Every scheduling shape, a user anti-affinity next to the operator's, pull secrets, pod metadata, the
# network policy's peers and an extraEnv reference: stored exactly as sent.
PLACEMENT = {
    "nodeSelector": {"nvidia.com/gpu.present": "true"},
    "tolerations": [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {
            "key": "maintenance",
            "operator": "Equal",
            "value": "soon",
            "effect": "NoExecute",
            "tolerationSeconds": 60,
        },
    ],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100", "h200"]}]}
                ]
            },
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 10,
                    "preference": {
                        "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["n1"]}]
                    },
                }
            ],
        },
        "podAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 50,
                    "podAffinityTerm": {
                        "labelSelector": {"matchLabels": {"app": "cache"}},
                        "namespaces": ["infra"],
                        "topologyKey": "topology.kubernetes.io/zone",
                    },
                }
            ]
        },
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchExpressions": [{"key": "app", "operator": "Exists"}]},
                    "namespaceSelector": {},
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        },
    },
    "topologySpreadConstraints": [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "engine"}},
        }
    ],
    "priorityClassName": "inference",
    "replicaAntiAffinity": "Preferred",
}


def _placement_and_metadata(obj: Manifest) -> Manifest:
    changed = with_change(obj, "spec.scheduling", copy.deepcopy(PLACEMENT))
    changed = with_change(changed, "spec.store.master.scheduling", {"nodeSelector": {"pool": "cpu"}})
    changed = with_change(changed, "spec.imagePullSecrets", [{"name": "regcred"}])
    changed = with_change(changed, "spec.podMetadata", {"labels": {"team": "a"}, "annotations": {"x/y": "z"}})
    changed = with_change(
        changed,
        "spec.networkPolicy",
        {
            "enabled": True,
            "operator": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}},
            "clients": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}],
        },
    )
    secret = {"secretKeyRef": {"name": "keys", "key": "api", "optional": True}}
    return with_change(changed, "spec.engine.extraEnv", [{"name": "API_KEY", "valueFrom": secret}])


def _claim_per_replica(obj: Manifest) -> Manifest:
    claim = {"volumeClaimTemplate": {"size": "600Gi", "storageClassName": "local-nvme"}}
    return with_change(obj, "spec.model.cache", claim)


def _single_replica_without_canary(obj: Manifest) -> Manifest:
    return with_change(with_change(obj, "spec.replicas", 1), "spec.canary.enabled", False)


CUSTOM_REQUEST = {
    "model": "MiniMaxAI/MiniMax-M2.5",
    "messages": [{"role": "user", "content": 'Return {"region": "us-west"}'}],
    "max_tokens": 64,
    "temperature": 0,
    "response_format": {"type": "json_object"},
    "extra": {"nested": [1, 2.5, None, True, {"deep": ["x", {"deeper": {}}]}], "empty": ""},
}


def _custom_canary_request(obj: Manifest) -> Manifest:
    changed = with_change(obj, "spec.canary.request", copy.deepcopy(CUSTOM_REQUEST))
    return with_change(
        changed,
        "spec.canary.expectations",
        [{"kind": "json_values_include", "values": ["us-west", 4, 16]}, {"kind": "json_object_only"}],
    )


def _existing_claim(obj: Manifest) -> Manifest:
    return with_change(obj, "spec.model.cache", {"existingClaim": "hf-cache"})


PRODUCTION_POD = {
    "securityContext": {"fsGroup": 1000, "fsGroupChangePolicy": "OnRootMismatch", "runAsUser": 1000},
    "serviceAccountName": "weights-reader",
    "automountServiceAccountToken": True,
    "runtimeClassName": "nvidia",
    "drainSeconds": 900,
    "volumes": [{"name": "creds", "secret": {"secretName": "s3-creds"}}, {"name": "scratch", "emptyDir": {}}],
    "volumeMounts": [{"name": "creds", "mountPath": "/etc/creds", "readOnly": True}],
    "sidecars": [
        {"name": "shipper", "image": "shipper:1", "ports": [{"containerPort": 9100, "name": "ship"}]}
    ],
    "initContainers": [
        {"name": "prefetch", "image": "prefetch:1", "volumeMounts": [{"name": "scratch", "mountPath": "/w"}]}
    ],
}


def _production_pod(obj: Manifest) -> Manifest:
    """Issue 24's engine pod: security contexts, identity, drain, every escape hatch, aliases, -pp."""
    changed = with_change(obj, "spec.pod", copy.deepcopy(PRODUCTION_POD))
    changed = with_change(
        changed,
        "spec.engine.securityContext",
        {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "readOnlyRootFilesystem": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    )
    changed = with_change(changed, "spec.engine.extraArgs", ["-pp", "2"])
    return with_change(changed, "spec.model.servedModelNameAliases", ["minimax"])


VALID_VARIANTS = {
    "production-pod": _production_pod,
    "no-speculative": _no_speculative,
    "rdma-with-device": _rdma,
    "one-replica-canary-off": _single_replica_without_canary,
    "custom-canary-request": _custom_canary_request,
    "existing-pvc-cache": _existing_claim,
    "rdma-host-network": _rdma_host_network,
    "placement-and-metadata": _placement_and_metadata,
    "claim-per-replica": _claim_per_replica,
}


@pytest.mark.parametrize("variant", list(VALID_VARIANTS))
async def test_valid_variants_are_stored_and_read_back_unchanged(
    kube: KubeClient, namespace: str, crd_installed: Manifest, variant: str
) -> None:
    obj = VALID_VARIANTS[variant](customer_example(namespace))
    expected = parse_resource(obj)  # valid for the models too

    stored = await create(kube, obj)

    assert parse_resource(stored).spec == expected.spec
    if variant == "no-speculative":
        assert "speculative" not in stored["spec"]
    if variant == "custom-canary-request":
        # x-kubernetes-preserve-unknown-fields: arbitrary JSON kept verbatim, nulls and "" included.
        assert stored["spec"]["canary"]["request"] == CUSTOM_REQUEST
        assert stored["spec"]["canary"]["expectations"][0]["values"] == ["us-west", 4, 16]
    if variant == "existing-pvc-cache":
        assert stored["spec"]["model"]["cache"] == {"existingClaim": "hf-cache"}
    if variant in ("placement-and-metadata", "rdma-host-network", "claim-per-replica", "production-pod"):
        assert_kept(obj["spec"], stored["spec"], "spec")


async def test_the_rdma_example_is_stored_as_is(
    kube: KubeClient, namespace: str, crd_installed: Manifest
) -> None:
    example = rdma_example(namespace)
    stored = await create(kube, example)
    assert_kept(example["spec"], stored["spec"], "spec")
    assert parse_resource(stored).spec == parse_resource(example).spec


# --------------------------------------------------------------------------- 4. invalid: server and models


# (dotted wire path, bad value, text the server's message contains). The schema forbids each.
SCHEMA_VIOLATIONS = {
    "tensor-parallel-zero": ("spec.engine.tensorParallelSize", 0, "spec.engine.tensorParallelSize"),
    "negative-replicas": ("spec.replicas", -1, "spec.replicas"),
    "unknown-protocol": ("spec.store.protocol", "infiniband", "spec.store.protocol"),
    "block-size-string": ("spec.engine.blockSize", "16", "spec.engine.blockSize"),
    "expectation-without-kind": (
        "spec.canary.expectations",
        [{"values": ["us-west"]}],
        "spec.canary.expectations.kind",  # 1.20 omits the index
    ),
    "segment-size-pattern": ("spec.store.globalSegmentSize", "80 gigs", "spec.store.globalSegmentSize"),
    "toleration-operator": (
        "spec.scheduling.tolerations",
        [{"key": "a", "operator": "Sometimes"}],
        "spec.scheduling.tolerations.operator",
    ),
    "spread-when-unsatisfiable": (
        "spec.scheduling.topologySpreadConstraints",
        [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "Maybe"}],
        "spec.scheduling.topologySpreadConstraints.whenUnsatisfiable",
    ),
    "anti-affinity-weight": (
        "spec.scheduling.affinity",
        {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 101, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname"}}
                ]
            }
        },
        "weight",
    ),
    "rdma-resource-count": (
        "spec.store.rdma",
        {"resourceName": "rdma/ib", "resourceCount": 0},
        "resourceCount",
    ),
    "memlock-mode": (
        "spec.store.rdma",
        {"resourceName": "rdma/ib", "memlock": "Off"},
        "spec.store.rdma.memlock",
    ),
    "replica-anti-affinity": ("spec.scheduling", {"replicaAntiAffinity": "Sometimes"}, "replicaAntiAffinity"),
}


@pytest.mark.parametrize("case", list(SCHEMA_VIOLATIONS))
async def test_server_and_models_both_reject_what_the_schema_forbids(
    kube: KubeClient, namespace: str, crd_installed: Manifest, case: str
) -> None:
    path, value, server_mentions = SCHEMA_VIOLATIONS[case]
    obj = with_change(customer_example(namespace), path, value)

    rejection = await server_rejection(kube, obj)
    assert server_mentions in rejection.message, rejection.message

    leaf = path.rsplit(".", 1)[1]
    problems = model_problems(obj)
    assert any(leaf in problem for problem in problems), problems

    assert await kube.list(API_VERSION, KIND, namespace) == [], "a rejected resource was stored"


async def test_unknown_spec_field_is_pruned_by_the_server_and_rejected_by_the_models(
    kube: KubeClient, namespace: str, crd_installed: Manifest
) -> None:
    """apiextensions.k8s.io/v1 CRDs always prune unknown fields: 1.20 stores the object without the field
    and says nothing (strict field validation arrived in 1.25). The server therefore never holds a typo,
    but it does not report one either; the models do (extra="forbid"), so `mooncake-operator render -f`
    and the operator's own validation name it."""
    typo = with_change(customer_example(namespace), "spec.store.globalSegmentSizes", "80GB")

    stored = await create(kube, typo)

    assert "globalSegmentSizes" not in stored["spec"]["store"]
    assert stored["spec"]["store"]["globalSegmentSize"] == "80GB"
    parse_resource(stored)  # what is stored is valid
    assert any("globalSegmentSizes" in problem for problem in model_problems(typo))


# Cross-field and semantic rules only the models enforce: 1.20's schema language has no CEL
# (x-kubernetes-validations), and quantities are int-or-string without a grammar. The server stores each
# of these; the operator rejects the resource whole (phase Invalid) before rendering anything.
#   - store.protocol rdma without store.deviceName
#   - store.mode embedded without a store.globalSegmentSize, or with a zero one; store.localBufferSize zero
#   - canary.enabled with replicas < 2
#   - speculative (Eagle-3) without a draft model or revision
#   - model.cache with both existingClaim and ephemeralSize
#   - engine.extraArgs / extraEnv repeating a setting the operator manages; engine.resources nvidia.com/gpu
#   - store.master rpcPort == metricsPort
#   - quantities that do not parse or are negative (model.cache.ephemeralSize, engine.resources ...)
#   - metadata.name longer than 40 characters (children's names and pod labels must fit in 63)
MODEL_ONLY_RULES: dict[str, tuple[str, Any, str]] = {
    "rdma-without-device": ("spec.store.protocol", "rdma", "deviceName"),
    "embedded-without-segment": ("spec.store.globalSegmentSize", None, "globalSegmentSize"),
    "zero-segment": ("spec.store.globalSegmentSize", "0GB", "globalSegmentSize"),
    "zero-local-buffer": ("spec.store.localBufferSize", "0MB", "localBufferSize"),
    "canary-with-one-replica": ("spec.replicas", 1, "at least 2 replicas"),
    "eagle3-without-draft-revision": ("spec.speculative.revision", None, "speculative.revision"),
    "cache-claim-and-ephemeral": ("spec.model.cache.existingClaim", "hf-cache", "not both"),
    "managed-extra-arg": ("spec.engine.extraArgs", ["--block-size=32"], "--block-size"),
    "managed-extra-env": (
        "spec.engine.extraEnv",
        [{"name": "PYTHONHASHSEED", "value": "1"}],
        "PYTHONHASHSEED",
    ),
    "gpu-in-resources": ("spec.engine.resources.limits", {"nvidia.com/gpu": 8}, "nvidia.com/gpu"),
    "master-ports-equal": ("spec.store.master.metricsPort", 50051, "must differ"),
    "unparseable-quantity": ("spec.model.cache.ephemeralSize", "lots", "cannot parse quantity"),
    "negative-quantity": ("spec.engine.sharedMemorySize", "-1Gi", "must not be negative"),
    "name-too-long": ("metadata.name", "m" * 41, "metadata.name"),
    "rdma-without-a-device-resource": ("spec.store.rdma", {"memlock": "Runtime"}, "store.rdma.resourceName"),
    "host-network-with-preferred": (
        "spec.store",
        {
            "globalSegmentSize": "80GB",
            "protocol": "rdma",
            "deviceName": "mlx5_0",
            "rdma": {"resourceName": "rdma/ib", "hostNetwork": True},
        },
        "",  # checked with the scheduling change below
    ),
    "managed-flag-underscores": ("spec.engine.extraArgs", ["--block_size=64"], "--block-size"),
    "managed-flag-dotted": (
        "spec.engine.extraArgs",
        ["--speculative-config.num_speculative_tokens=7"],
        "--speculative-config",
    ),
    "managed-flag-short": (
        "spec.engine.extraArgs",
        ["-tp", "8"],
        "-tp: it is set from engine.tensorParallelSize",
    ),
    "managed-flag-abbreviated": ("spec.engine.extraArgs", ["--kv-transfer={}"], "--kv-transfer-config"),
    "operator-label": (
        "spec.podMetadata",
        {"labels": {"app.kubernetes.io/component": "x"}},
        "podMetadata.labels",
    ),
    "env-value-and-reference": (
        "spec.engine.extraEnv",
        [{"name": "A", "value": "1", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}],
        "exactly one of value and valueFrom",
    ),
    # The example's cache is a volumeClaimTemplate.
    "claim-and-ephemeral": ("spec.model.cache.ephemeralSize", "1Ti", "not both"),
}


@pytest.mark.parametrize("case", list(MODEL_ONLY_RULES))
async def test_rules_beyond_the_schema_pass_the_server_and_are_caught_by_the_models(
    kube: KubeClient, namespace: str, crd_installed: Manifest, case: str
) -> None:
    path, value, model_mentions = MODEL_ONLY_RULES[case]
    obj = with_change(customer_example(namespace), path, value)
    if case == "host-network-with-preferred":
        obj = with_change(obj, "spec.scheduling", {"replicaAntiAffinity": "Preferred"})
        model_mentions = "scheduling.replicaAntiAffinity must be Required"
    if case == "rdma-without-a-device-resource":
        obj = _rdma(obj)
        obj = with_change(obj, "spec.store.rdma", value)

    stored = await create(kube, obj)  # the server cannot express the rule

    problems = model_problems(stored)
    assert any(model_mentions in problem for problem in problems), problems


# --------------------------------------------------------------------------- 5. status and printer columns


def table_of(plane: ControlPlane, namespace: str, name: str) -> Manifest:
    path = f"/apis/{API_VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
    with plane.client() as http:
        response = http.get(path, headers={"Accept": TABLE_ACCEPT})
    assert response.status_code == 200, response.text
    table: Manifest = response.json()
    assert table["kind"] == "Table", table
    return table


async def test_status_subresource_and_printer_columns(
    kube: KubeClient, kube_cluster: ControlPlane, namespace: str, crd_installed: Manifest
) -> None:
    columns = crd_installed["spec"]["versions"][0]["additionalPrinterColumns"]
    assert [(c["name"], c["type"], c["jsonPath"], c.get("priority", 0)) for c in columns] == [
        ("Model", "string", ".spec.model.name", 0),
        ("Ready-Replicas", "integer", ".status.replicas.ready", 0),
        ("Desired", "integer", ".status.replicas.desired", 0),
        ("Phase", "string", ".status.phase", 0),
        ("Canary", "string", ".status.canary.verdict", 0),
        ("ExtHit", "integer", ".status.canary.externalHitTokens", 1),
        ("Serving", "integer", ".status.traffic.serving", 0),
        ("Candidate", "string", ".status.rollout.candidatePhase", 1),
        ("Ready", "string", '.status.conditions[?(@.type=="Ready")].status', 0),
        ("Age", "date", ".metadata.creationTimestamp", 0),
    ]
    example = customer_example(namespace)
    name = example["metadata"]["name"]
    created = await create(kube, example)
    status = {
        "phase": "Ready",
        "observedGeneration": created["metadata"]["generation"],
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "CanaryPassed",
                "message": "",  # "" must be a value here too (k/k#99804, patched in scripts/build-kube)
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            },
            {
                "type": "MasterReady",
                "status": "True",
                "reason": "MasterAvailable",
                "message": "1/1 master pods ready",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            },
        ],
        "replicas": {"desired": 2, "ready": 2},
        "traffic": {"serving": 2},
        "rollout": {
            "strategy": "BlueGreen",
            "servingSet": f"{name}-replica",
            "candidateSet": f"{name}-r1a2b3c4",
            "candidatePhase": "Held",
        },
        "canary": {
            "runId": "run-1",
            "verdict": "Passed",
            "externalHitTokens": 128,
            "pairs": [{"writer": f"{name}-replica-0", "reader": f"{name}-replica-1", "verdict": "Passed"}],
        },
    }

    patched = await kube.patch_status(API_VERSION, KIND, name, status, namespace, field_manager=MANAGER)

    assert patched["status"]["conditions"][0]["message"] == ""
    assert patched["status"]["canary"]["externalHitTokens"] == 128
    assert patched["spec"] == created["spec"], "a status patch must not touch the spec"
    assert patched["metadata"]["generation"] == created["metadata"]["generation"]
    parsed = parse_resource(patched)
    assert parsed.status is not None and parsed.status.conditions[0].message == ""

    # A status sent through the main resource is ignored: only the subresource writes it.
    await kube.patch_merge(
        API_VERSION, KIND, name, {"status": {"phase": "Degraded"}}, namespace, field_manager=MANAGER
    )
    assert (await kube.get(API_VERSION, KIND, name, namespace))["status"]["phase"] == "Ready"

    # A status the schema forbids is rejected by the status subresource as well.
    with pytest.raises(KubeApiError) as caught:
        await kube.patch_status(
            API_VERSION, KIND, name, {"phase": "Sleeping"}, namespace, field_manager=MANAGER
        )
    assert caught.value.status == 422 and "status.phase" in caught.value.message, caught.value

    table = table_of(kube_cluster, namespace, name)
    headers = [c["name"] for c in table["columnDefinitions"]]
    assert headers == [
        "Name",
        "Model",
        "Ready-Replicas",
        "Desired",
        "Phase",
        "Canary",
        "ExtHit",
        "Serving",
        "Candidate",
        "Ready",
        "Age",
    ]
    wide = {c["name"] for c in table["columnDefinitions"] if c.get("priority")}
    assert wide == {"ExtHit", "Candidate"}  # kubectl shows them with -o wide
    (row,) = table["rows"]
    cells = dict(zip(headers, row["cells"], strict=True))
    assert cells["Name"] == name
    assert cells["Model"] == example["spec"]["model"]["name"]
    shown = ("Ready-Replicas", "Desired", "Phase", "Canary", "ExtHit", "Serving", "Candidate", "Ready")
    assert tuple(cells[column] for column in shown) == (2, 2, "Ready", "Passed", 128, 2, "Held", "True")
    assert isinstance(cells["Age"], str) and cells["Age"], cells


# --------------------------------------------------------------------------- 6. rendered children dry-run


async def served_policy_version(kube: KubeClient) -> str:
    served = await kube.served_versions("policy")
    return POLICY_V1 if "v1" in served else POLICY_V1BETA1


async def test_the_disruption_budget_is_policy_v1_where_served_and_the_same_in_v1beta1(
    kube: KubeClient,
) -> None:
    """Kubernetes 1.25+ serves PodDisruptionBudget only as policy/v1 (what `render` prints); this 1.20
    server only as policy/v1beta1, which has the same fields. The operator asks which one is served."""
    served = await kube.served_versions("policy")
    assert "v1beta1" in served, served
    resource = parse_resource(customer_example("default"))
    v1 = pod_disruption_budget(resource, owner_uid=None)
    beta = pod_disruption_budget(resource, owner_uid=None, api_version=POLICY_V1BETA1)
    assert v1["apiVersion"] == "policy/v1"
    assert {**v1, "apiVersion": beta["apiVersion"]} == beta


@pytest.mark.parametrize("example", ["customer", "rdma", "production-pod"])
async def test_every_rendered_child_passes_a_server_side_dry_run_and_nothing_is_written(
    kube: KubeClient, namespace: str, crd_installed: Manifest, example: str
) -> None:
    obj = {
        "customer": lambda: customer_example(namespace),
        "rdma": lambda: rdma_example(namespace),
        "production-pod": lambda: _production_pod(customer_example(namespace)),
    }[example]()
    owner = await create(kube, obj)
    resource = parse_resource(owner)
    policy = await served_policy_version(kube)
    children = render_all(resource, owner_uid=owner["metadata"]["uid"], policy_api_version=policy)
    kinds = [(c["apiVersion"], c["kind"]) for c in children]
    assert {
        ("v1", "ConfigMap"),
        ("v1", "Service"),
        ("apps/v1", "Deployment"),
        ("apps/v1", "StatefulSet"),
        (policy, "PodDisruptionBudget"),
        ("networking.k8s.io/v1", "NetworkPolicy"),
    } <= set(kinds), kinds

    before = kube.counts.snapshot()
    for child in children:
        answered = await kube.apply(child, field_manager=MANAGER, dry_run=True)
        label = f"{child['kind']}/{child['metadata']['name']}"
        assert answered["metadata"]["name"] == child["metadata"]["name"], label
        # The server kept every rendered value (it adds defaults; a field it does not know would be dropped).
        sent, kept = child.get("spec", child.get("data")), answered.get("spec", answered.get("data"))
        assert holds(sent, kept), f"{label}: the server did not keep what was rendered:\n{sent}\n{kept}"
        assert answered["metadata"]["ownerReferences"] == child["metadata"]["ownerReferences"], label
        assert answered["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"], label
    spent = kube.counts.since(before)
    assert spent.dry_runs == len(children) and spent.writes == 0, spent

    instance = f"{LABEL_INSTANCE}={resource.metadata.name}"
    for api_version, kind in sorted(set(kinds)):
        stored = await kube.list(api_version, kind, namespace, label_selector=instance)
        assert stored == [], f"dry run stored a {kind}"
    for child in children:
        found = await kube.get_or_none(
            child["apiVersion"], child["kind"], child["metadata"]["name"], namespace
        )
        assert found is None, f"dry run stored {child['kind']}/{child['metadata']['name']}"
