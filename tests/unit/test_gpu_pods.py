"""Pods for a real GPU cluster: scheduling, pod metadata, cache storage, RDMA, hardening, network policy,
disruption budget; engine flags as vLLM's parser reads them; environment references; immutable claims."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from tests.support.fake_api import runtime_answering

from mooncake_operator.api.engine_flags import managed_flag_of
from mooncake_operator.api.examples import reference_deployment_yaml
from mooncake_operator.api.group import OPERATOR_KEY_PREFIX, OPERATOR_LABEL_KEYS, replica_pod_labels
from mooncake_operator.api.kube_types import LabelSelector
from mooncake_operator.api.resource import InvalidResourceError, MooncakeServing, parse_resource
from mooncake_operator.build.disruption import POLICY_V1BETA1, pod_disruption_budget
from mooncake_operator.build.manifests import render_all
from mooncake_operator.build.master import master_deployment
from mooncake_operator.build.names import CONFIG_HASH_ANNOTATION, TRAFFIC_LABEL
from mooncake_operator.build.network_policy import network_policies
from mooncake_operator.build.replicas import HF_HOME, replica_stateful_set
from mooncake_operator.build.store_config import store_config_json, store_config_map
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.kube.config import KubeConfig
from mooncake_operator.reconcile.act.cache import WatchCache, WatchedKind
from mooncake_operator.reconcile.act.children import (
    ImmutableChangeError,
    ensure_children,
    immutable_changes,
    with_applied_hash,
)
from mooncake_operator.reconcile.decide.revisions import last_good_manifest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
RDMA_EXAMPLE = REPO / "examples" / "minimax-m2.5-eagle3-rdma.yaml"


def example() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(reference_deployment_yaml())
    return loaded


def rdma_example() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(RDMA_EXAMPLE.read_text(encoding="utf-8"))
    return loaded


def changed(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    *parents, leaf = path.split(".")
    node = out
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return out


def problems_of(obj: dict[str, Any]) -> list[str]:
    with pytest.raises(InvalidResourceError) as caught:
        parse_resource(obj)
    return caught.value.problems


def with_rdma(obj: dict[str, Any], rdma: dict[str, Any]) -> dict[str, Any]:
    out = changed(obj, "spec.store.protocol", "rdma")
    out = changed(out, "spec.store.deviceName", "mlx5_0")
    return changed(out, "spec.store.rdma", rdma)


def pod_spec(resource: MooncakeServing) -> dict[str, Any]:
    spec: dict[str, Any] = replica_stateful_set(resource, owner_uid=None)["spec"]["template"]["spec"]
    return spec


def engine(resource: MooncakeServing) -> dict[str, Any]:
    container: dict[str, Any] = pod_spec(resource)["containers"][0]
    return container


# --------------------------------------------------------------------------- engine flags


@pytest.mark.parametrize(
    ("arg", "managed"),
    [
        ("--block-size=64", "--block-size"),
        ("--block_size=64", "--block-size"),
        ("--block_size", "--block-size"),
        ("--kv_transfer_config={}", "--kv-transfer-config"),
        ("--kv-transfer-config.kv_role=kv_producer", "--kv-transfer-config"),
        ("--speculative-config.num_speculative_tokens=7", "--speculative-config"),
        ("--speculative_config.num_speculative_tokens", "--speculative-config"),
        ("-sc.num_speculative_tokens=7", "-sc"),
        ("-tp", "-tp"),
        ("-tp=8", "-tp"),
        ("--tensor_parallel_size=8", "--tensor-parallel-size"),
        ("--no-trust-remote-code", "--no-trust-remote-code"),
        ("--served_model_name=x", "--served-model-name"),
        ("--config=/etc/vllm.yaml", "--config"),
        # argparse abbreviations (allow_abbrev is on in vLLM's parsers)
        ("--block=64", "--block-size"),
        ("--kv-transfer", "--kv-transfer-config"),
        ("--max_model=1", "--max-model-len"),
        ("--tokenizer-rev=abc", "--tokenizer-revision"),
        ("-s", "-sc"),
        # the per-request evidence the canary reads from every answer
        ("--enable-prompt-tokens-details", "--enable-prompt-tokens-details"),
        ("--enable_prompt_tokens_details", "--enable-prompt-tokens-details"),
        ("--no-enable-prompt-tokens-details", "--no-enable-prompt-tokens-details"),
        ("--enable-prompt-tokens", "--enable-prompt-tokens-details"),
        ("--per-request-spec-decode-metrics=none", "--per-request-spec-decode-metrics"),
        ("--per_request_spec_decode_metrics", "--per-request-spec-decode-metrics"),
        ("--per-request-spec=detailed", "--per-request-spec-decode-metrics"),
    ],
)
def test_a_managed_flag_is_found_in_every_spelling_vllm_accepts(arg: str, managed: str) -> None:
    found = managed_flag_of(arg)
    assert found is not None and found[0] == managed
    problems = problems_of(changed(example(), "spec.engine.extraArgs", [arg]))
    assert any(f"engine.extraArgs must not contain {managed}" in p for p in problems), problems


@pytest.mark.parametrize(
    "args",
    [
        ["--enable-prompt-embeds"],
        ["--enable-per-request-metrics"],  # timing metrics: not the evidence flags the operator renders
        ["--tokenizer", "org/tok"],  # an option of its own, not an abbreviation of --tokenizer-revision
        ["--gpu-memory-utilization=0.9", "--max-num-seqs", "64"],
        ["--compilation-config.level=3", "-O3"],
        ["--override-generation-config", '{"temperature": 0}'],
        ["--seed", "-1"],
    ],
)
def test_unmanaged_arguments_and_their_values_pass(args: list[str]) -> None:
    assert parse_resource(changed(example(), "spec.engine.extraArgs", args)).spec.engine.extra_args == args


# --------------------------------------------------------------------------- invalid combinations

INVALID: list[tuple[str, Any, str]] = [
    ("spec.store.rdma", {"resourceCount": 2}, "store.rdma needs a device: set store.rdma.resourceName"),
    (
        "spec.store.rdma",
        {"resourceName": "rdma/ib", "hostNetwork": True, "networks": "net"},
        "store.rdma.networks (Multus) has no effect with store.rdma.hostNetwork",
    ),
    ("spec.store.rdma", {"resourceName": "nvidia.com/gpu"}, "must not be nvidia.com/gpu"),
    (
        "spec.podMetadata",
        {"labels": {"app.kubernetes.io/instance": "x"}},
        "podMetadata.labels: app.kubernetes",
    ),
    ("spec.podMetadata", {"labels": {"serving.mooncake-operator.dev/traffic": "off"}}, "set by the operator"),
    (
        "spec.podMetadata",
        {"annotations": {"serving.mooncake-operator.dev/config-hash": "x"}},
        "podMetadata.annotations: serving.mooncake-operator.dev/config-hash is set by the operator",
    ),
    ("spec.podMetadata", {"labels": {"team": "a b"}}, "not a valid label value"),
    ("spec.podMetadata", {"labels": {"-bad": "a"}}, "is not a valid key"),
    ("spec.podMetadata", {"annotations": {"k8s.v1.cni.cncf.io/networks": "n"}}, "store.rdma.networks"),
    ("spec.engine.extraEnv", [{"name": "A"}], "set exactly one of value and valueFrom"),
    (
        "spec.engine.extraEnv",
        [{"name": "A", "valueFrom": {}}],
        "valueFrom needs exactly one of secretKeyRef and configMapKeyRef",
    ),
    (
        "spec.engine.extraEnv",
        [{"name": "MOONCAKE_REQUESTER_LOCAL_HOSTNAME", "value": "10.0.0.1"}],
        "must not set MOONCAKE_REQUESTER_LOCAL_HOSTNAME",
    ),
    ("spec.model.cache", {"ephemeralSize": "1Ti", "volumeClaimTemplate": {"size": "1Ti"}}, "not both"),
    ("spec.model.cache", {"volumeClaimTemplate": {"size": "0"}}, "size must be greater than zero"),
    ("spec.networkPolicy", {"clients": [{}]}, "needs podSelector, namespaceSelector or ipBlock"),
    (
        "spec.networkPolicy",
        {"clients": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]},
        "either ipBlock or podSelector/namespaceSelector",
    ),
    (
        "spec.scheduling",
        {"tolerations": [{"operator": "Sometimes"}]},
        "spec.scheduling.tolerations.0.operator",
    ),
]


@pytest.mark.parametrize(
    ("path", "value", "message"), INVALID, ids=[f"{p}={v!r}"[:70] for p, v, _ in INVALID]
)
def test_invalid_settings_are_refused_with_the_field_name(path: str, value: Any, message: str) -> None:
    obj = changed(example(), path, value)
    if path == "spec.store.rdma":
        obj = with_rdma(obj, value)
    problems = problems_of(obj)
    assert any(message in problem for problem in problems), problems


def test_rdma_needs_a_device_and_rdma_settings_need_rdma() -> None:
    no_section = changed(changed(example(), "spec.store.protocol", "rdma"), "spec.store.deviceName", "mlx5_0")
    assert any("store.protocol rdma needs store.rdma with a device" in p for p in problems_of(no_section))
    on_tcp = changed(example(), "spec.store.rdma", {"resourceName": "rdma/ib"})
    assert any("store.rdma is set but store.protocol is tcp" in p for p in problems_of(on_tcp))
    parse_resource(with_rdma(example(), {"hostDevices": True}))


def test_host_network_refuses_two_replicas_per_node() -> None:
    host = with_rdma(example(), {"resourceName": "rdma/ib", "hostNetwork": True})
    for mode in ("Preferred", "None"):
        problems = problems_of(changed(host, "spec.scheduling", {"replicaAntiAffinity": mode}))
        assert any("scheduling.replicaAntiAffinity must be Required" in p for p in problems), problems
    own = {"app.kubernetes.io/instance": "minimax-m25", "app.kubernetes.io/component": "engine"}
    together = {
        "affinity": {
            "podAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {"labelSelector": {"matchLabels": own}, "topologyKey": "kubernetes.io/hostname"}
                ]
            }
        }
    }
    problems = problems_of(changed(host, "spec.scheduling", together))
    assert any("spec.scheduling.affinity.podAffinity requires replicas on one node" in p for p in problems)
    # Co-location with another application is fine; so is co-location without hostNetwork.
    other = copy.deepcopy(together)
    term = other["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    term["labelSelector"] = {"matchLabels": {"app": "cache"}}
    parse_resource(changed(host, "spec.scheduling", other))
    parse_resource(changed(example(), "spec.scheduling", together))


@pytest.mark.parametrize(
    ("selector", "selected"),
    [
        ({}, True),
        ({"matchLabels": {"app.kubernetes.io/instance": "n"}}, True),
        ({"matchLabels": {"app.kubernetes.io/instance": "m"}}, False),
        (
            {
                "matchExpressions": [
                    {"key": "app.kubernetes.io/component", "operator": "In", "values": ["engine"]}
                ]
            },
            True,
        ),
        (
            {
                "matchExpressions": [
                    {"key": "app.kubernetes.io/component", "operator": "NotIn", "values": ["engine"]}
                ]
            },
            False,
        ),
        ({"matchExpressions": [{"key": "team", "operator": "DoesNotExist"}]}, True),
        ({"matchExpressions": [{"key": "team", "operator": "Exists"}]}, False),
    ],
)
def test_label_selectors_select_as_kubernetes_does(selector: dict[str, Any], selected: bool) -> None:
    parsed = LabelSelector.model_validate(selector)
    assert parsed.matches(replica_pod_labels("n")) is selected


def test_the_models_know_the_replica_pods_labels_and_the_operators_keys() -> None:
    resource = parse_resource(example())
    template = replica_stateful_set(resource, owner_uid=None)["spec"]["template"]["metadata"]
    operator_labels = {k: v for k, v in template["labels"].items() if k != TRAFFIC_LABEL}
    assert operator_labels == replica_pod_labels(resource.metadata.name)
    assert set(operator_labels) == OPERATOR_LABEL_KEYS
    assert TRAFFIC_LABEL.startswith(OPERATOR_KEY_PREFIX)
    assert CONFIG_HASH_ANNOTATION.startswith(OPERATOR_KEY_PREFIX)


# --------------------------------------------------------------------------- scheduling and metadata


def test_replicas_spread_over_nodes_by_default_and_the_users_affinity_is_kept() -> None:
    default = pod_spec(parse_resource(example()))["affinity"]
    term = default["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term == [
        {
            "weight": 100,
            "podAffinityTerm": {
                "labelSelector": {
                    "matchLabels": {
                        "app.kubernetes.io/instance": "minimax-m25",
                        "app.kubernetes.io/component": "engine",
                    }
                },
                "topologyKey": "kubernetes.io/hostname",
            },
        }
    ]
    user_term = {"weight": 5, "podAffinityTerm": {"topologyKey": "zone", "labelSelector": {}}}
    node = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchFields": []}]}}
    users = {
        "affinity": {
            "nodeAffinity": node,
            "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [user_term]},
        },
        "nodeSelector": {"gpu": "h100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}
        ],
        "priorityClassName": "high",
    }
    spec = pod_spec(parse_resource(changed(example(), "spec.scheduling", users)))
    assert spec["affinity"]["nodeAffinity"] == node
    merged = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert merged == [user_term, *term]  # the user's first, ours appended
    for key in ("nodeSelector", "tolerations", "topologySpreadConstraints", "priorityClassName"):
        assert spec[key] == users[key], key
    required = pod_spec(
        parse_resource(changed(example(), "spec.scheduling", {"replicaAntiAffinity": "Required"}))
    )
    anti = required["affinity"]["podAntiAffinity"]
    assert anti == {"requiredDuringSchedulingIgnoredDuringExecution": [term[0]["podAffinityTerm"]]}
    off = {"replicaAntiAffinity": "None", "affinity": {"nodeAffinity": node}}
    assert pod_spec(parse_resource(changed(example(), "spec.scheduling", off)))["affinity"] == {
        "nodeAffinity": node
    }
    assert "affinity" not in pod_spec(
        parse_resource(changed(example(), "spec.scheduling", {"replicaAntiAffinity": "None"}))
    )


def test_master_scheduling_pull_secrets_and_pod_metadata() -> None:
    obj = changed(
        example(), "spec.store.master.scheduling", {"nodeSelector": {"pool": "cpu"}, "priorityClassName": "p"}
    )
    obj = changed(obj, "spec.imagePullSecrets", [{"name": "regcred"}])
    obj = changed(obj, "spec.podMetadata", {"labels": {"team": "a"}, "annotations": {"example.com/x": "y"}})
    resource = parse_resource(obj)
    master = master_deployment(resource, owner_uid=None)["spec"]["template"]
    assert master["spec"]["nodeSelector"] == {"pool": "cpu"} and master["spec"]["priorityClassName"] == "p"
    assert "affinity" not in master["spec"]  # the replicas' spread is not the master's
    replica = replica_stateful_set(resource, owner_uid=None)["spec"]["template"]
    for template in (master, replica):
        assert template["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
        assert template["spec"]["automountServiceAccountToken"] is False
        assert template["metadata"]["labels"]["team"] == "a"
        assert template["metadata"]["annotations"]["example.com/x"] == "y"
    assert "nodeSelector" not in replica["spec"]
    # Selectors never carry user labels (they are immutable).
    stateful_set = replica_stateful_set(resource, owner_uid=None)
    assert "team" not in stateful_set["spec"]["selector"]["matchLabels"]


# --------------------------------------------------------------------------- storage


def test_an_ephemeral_cache_is_requested_as_ephemeral_storage() -> None:
    obj = changed(
        changed(example(), "spec.model.cache", {"ephemeralSize": "600Gi"}),
        "spec.engine.resources",
        {"requests": {"ephemeral-storage": "20Gi"}, "limits": {"ephemeral-storage": "50Gi"}},
    )
    resources = engine(parse_resource(obj))["resources"]
    # The engine's own + the 600Gi cache + the 10Gi /tmp scratch.
    assert resources["requests"]["ephemeral-storage"] == "630Gi"
    assert resources["limits"]["ephemeral-storage"] == "660Gi"
    claim = changed(example(), "spec.model.cache", {"existingClaim": "shared"})
    # A claim holds the weights: only the scratch is on the node's disk.
    assert engine(parse_resource(claim))["resources"]["requests"]["ephemeral-storage"] == "10Gi"


def test_a_claim_per_replica_replaces_the_cache_volume() -> None:
    obj = changed(
        example(), "spec.model.cache", {"volumeClaimTemplate": {"size": "600Gi", "storageClassName": "nvme"}}
    )
    resource = parse_resource(obj)
    stateful_set = replica_stateful_set(resource, owner_uid=None)
    assert stateful_set["spec"]["volumeClaimTemplates"] == [
        {
            "metadata": {
                "name": "hf-cache",
                "labels": {
                    "app.kubernetes.io/instance": "minimax-m25",
                    "app.kubernetes.io/component": "engine",
                },
            },
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "600Gi"}},
                "storageClassName": "nvme",
            },
        }
    ]
    volumes = [v["name"] for v in stateful_set["spec"]["template"]["spec"]["volumes"]]
    assert "hf-cache" not in volumes
    assert {"name": "hf-cache", "mountPath": HF_HOME} in engine(resource)["volumeMounts"]
    assert engine(resource)["resources"]["requests"]["ephemeral-storage"] == "10Gi"  # the scratch alone


def with_hash(manifest: dict[str, Any]) -> dict[str, Any]:
    return with_applied_hash(manifest)


def test_changed_claims_of_an_existing_stateful_set_are_refused() -> None:
    def stateful_set(cache: dict[str, Any]) -> dict[str, Any]:
        resource = parse_resource(changed(example(), "spec.model.cache", cache))
        return with_hash(replica_stateful_set(resource, owner_uid="u"))

    claim = {"volumeClaimTemplate": {"size": "600Gi"}}
    live = copy.deepcopy(stateful_set(claim))
    live["spec"]["volumeClaimTemplates"][0]["spec"]["volumeMode"] = "Filesystem"  # a server default
    live["spec"]["volumeClaimTemplates"][0]["status"] = {"phase": "Pending"}
    assert immutable_changes(stateful_set(claim), live) == []
    assert immutable_changes(stateful_set(claim), None) == []
    bigger = stateful_set({"volumeClaimTemplate": {"size": "1Ti"}})
    (problem,) = immutable_changes(bigger, live)
    assert "model.cache.volumeClaimTemplate" in problem and "StatefulSet minimax-m25-replica" in problem
    assert immutable_changes(stateful_set({"ephemeralSize": "1Ti"}), live), "removing the claims is a change"
    ephemeral_live = stateful_set({"ephemeralSize": "1Ti"})
    assert immutable_changes(stateful_set(claim), ephemeral_live), "adding claims is a change"
    config_map = with_hash(store_config_map(parse_resource(example()), owner_uid="u"))
    assert immutable_changes(config_map, {"data": {}}) == []


async def test_nothing_is_applied_when_one_child_cannot_change() -> None:
    """Every child is read first; the refusal comes before the first write (no half-applied rollout)."""
    old = parse_resource(changed(example(), "spec.model.cache", {"volumeClaimTemplate": {"size": "600Gi"}}))
    new = parse_resource(
        changed(
            changed(example(), "spec.model.cache", {"volumeClaimTemplate": {"size": "1Ti"}}),
            "spec.engine.image",
            "engine:2",
        )
    )
    live = {m["metadata"]["name"] + "/" + m["kind"]: with_hash(m) for m in render_all(old, owner_uid="u")}
    requests: list[tuple[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append((request.method, request.url.path))
        return httpx.Response(500, json={"kind": "Status", "code": 500, "message": "no request expected"})

    kube = KubeClient(
        KubeConfig(server="https://127.0.0.1:6443", token="t"), transport=httpx.MockTransport(handler)
    )
    kinds = {(m["apiVersion"], m["kind"]) for m in live.values()}
    cache = WatchCache(
        kube,
        namespaces=("default",),
        on_change=lambda *_: None,
        kinds=tuple(WatchedKind(version, kind, None) for version, kind in sorted(kinds)),
    )
    for manifest in live.values():  # what the watches would hold
        cache.remember({**manifest, "metadata": {**manifest["metadata"], "resourceVersion": "1"}})
    try:
        with pytest.raises(ImmutableChangeError) as caught:
            await ensure_children(kube, cache, render_all(new, owner_uid="u"))
    finally:
        await kube.aclose()
    assert "model.cache.volumeClaimTemplate" in caught.value.problems[0]
    assert requests == []  # read from the cache; nothing written
    assert kube.counts.writes == 0


def render_plural(kind: str) -> str:
    return {
        "ConfigMap": "configmaps",
        "Service": "services",
        "Deployment": "deployments",
        "StatefulSet": "statefulsets",
        "PodDisruptionBudget": "poddisruptionbudgets",
        "NetworkPolicy": "networkpolicies",
    }[kind]


# --------------------------------------------------------------------------- RDMA


def test_the_rdma_example_renders_pods_that_can_use_rdma() -> None:
    resource = parse_resource(rdma_example())
    container = engine(resource)
    template = replica_stateful_set(resource, owner_uid=None)["spec"]["template"]
    assert container["command"][:3] == ["/bin/sh", "-c", 'ulimit -l unlimited && exec "$0" "$@"']
    assert container["command"][3:5] == ["vllm", "serve"]
    assert container["securityContext"] == {
        "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK", "SYS_RESOURCE"]},
        "allowPrivilegeEscalation": False,
    }
    assert container["resources"]["requests"]["rdma/hca_shared_devices_a"] == "1"
    assert container["resources"]["limits"]["rdma/hca_shared_devices_a"] == "1"
    assert template["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "rdma-net"
    local = next(e for e in container["env"] if e["name"] == "MOONCAKE_REQUESTER_LOCAL_HOSTNAME")
    assert local == {
        "name": "MOONCAKE_REQUESTER_LOCAL_HOSTNAME",
        "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}},
    }
    config = json.loads(store_config_json(resource))
    assert (config["protocol"], config["device_name"]) == ("rdma", "mlx5_0")
    assert "hostNetwork" not in template["spec"]


def test_host_devices_host_network_and_the_runtimes_memlock() -> None:
    obj = with_rdma(example(), {"hostDevices": True, "hostNetwork": True, "memlock": "Runtime"})
    resource = parse_resource(obj)
    spec, container = pod_spec(resource), engine(resource)
    assert container["command"][:2] == ["vllm", "serve"]  # no wrapper
    assert container["securityContext"] == {"privileged": True}
    assert {"name": "rdma-devices", "hostPath": {"path": "/dev/infiniband"}} in spec["volumes"]
    assert {"name": "rdma-devices", "mountPath": "/dev/infiniband"} in container["volumeMounts"]
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert "requiredDuringSchedulingIgnoredDuringExecution" in spec["affinity"]["podAntiAffinity"]
    runtime = parse_resource(with_rdma(example(), {"resourceName": "rdma/ib", "memlock": "Runtime"}))
    assert engine(runtime)["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}


def test_tcp_pods_carry_nothing_rdma() -> None:
    resource = parse_resource(example())
    container = engine(resource)
    assert "add" not in container["securityContext"]["capabilities"]
    assert "privileged" not in container["securityContext"]
    assert container["command"][:2] == ["vllm", "serve"]
    assert not any(key.startswith("rdma/") for key in container["resources"]["requests"])


# --------------------------------------------------------------------------- hardening


def test_the_master_runs_unprivileged_without_gpus() -> None:
    container = master_deployment(parse_resource(example()), owner_uid=None)["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert container["env"] == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    context = container["securityContext"]
    assert context["runAsNonRoot"] is True and context["runAsUser"] != 0
    assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}


def policies(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p["spec"] for p in network_policies(parse_resource(obj), owner_uid=None)}


def test_network_policies_admit_only_what_each_port_needs() -> None:
    own = {
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/instance": "minimax-m25",
                "app.kubernetes.io/component": "engine",
            }
        }
    }
    found = policies(example())
    master = found["minimax-m25-master"]
    assert master["podSelector"] == {
        "matchLabels": {
            "app.kubernetes.io/instance": "minimax-m25",
            "app.kubernetes.io/component": "store-master",
        }
    }
    assert master["ingress"] == [{"from": [own], "ports": [{"protocol": "TCP", "port": 50051}]}]
    replicas = found["minimax-m25-replica"]
    assert replicas["ingress"] == [{"from": [own]}, {"ports": [{"protocol": "TCP", "port": 8000}]}]
    assert replicas["policyTypes"] == master["policyTypes"] == ["Ingress"]

    client = {"ipBlock": {"cidr": "10.0.0.0/8"}}
    declared = changed(example(), "spec.networkPolicy", {"clients": [client]})
    found = policies(declared)
    # The master's metrics port also serves its admin API (remove_all, quotas, drains): clients never.
    assert found["minimax-m25-master"]["ingress"] == master["ingress"]
    scraper = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    with pytest.raises(InvalidResourceError, match=r"networkPolicy\.metricsScrapers"):
        parse_resource(changed(example(), "spec.networkPolicy", {"metricsScrapers": [scraper]}))
    http = found["minimax-m25-replica"]["ingress"][1]
    operator = {
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "mooncake-operator"}},
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mooncake-system"}},
    }
    assert http["from"] == [operator, client]
    assert policies(changed(example(), "spec.networkPolicy", {"enabled": False})) == {}


def test_the_operator_is_admitted_from_its_own_namespace_only() -> None:
    """A tenant can label its own pods app.kubernetes.io/name=mooncake-operator: the label alone must not
    admit them to another tenant's replicas or masters."""
    declared = changed(example(), "spec.networkPolicy", {"clients": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]})
    policy = network_policies(parse_resource(declared), owner_uid=None, operator_namespace="ops")
    operator = policy[1]["spec"]["ingress"][1]["from"][0]
    assert operator["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}
    assert all(
        peer.get("namespaceSelector") != {}
        for manifest in policy
        for rule in manifest["spec"]["ingress"]
        for peer in rule.get("from", [])
    )


def test_the_disruption_budget_and_its_api_versions() -> None:
    resource = parse_resource(example())
    budget = pod_disruption_budget(resource, owner_uid=None)
    assert budget["apiVersion"] == "policy/v1"
    assert budget["spec"] == {
        "maxUnavailable": 1,
        "selector": {
            "matchLabels": {
                "app.kubernetes.io/instance": "minimax-m25",
                "app.kubernetes.io/component": "engine",
            }
        },
    }
    beta = render_all(resource, owner_uid=None, policy_api_version=POLICY_V1BETA1)[-1]
    assert beta == {**budget, "apiVersion": "policy/v1beta1"}
    with pytest.raises(ValueError, match="apiVersion must be one of"):
        pod_disruption_budget(resource, owner_uid=None, api_version="policy/v2")


# --------------------------------------------------------------------------- secrets stay references


def test_secret_references_pass_through_and_never_carry_a_value() -> None:
    env = [
        {"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "api"}}},
        {
            "name": "REGION",
            "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "region", "optional": True}},
        },
        {"name": "PLAIN", "value": "1"},
    ]
    resource = parse_resource(changed(example(), "spec.engine.extraEnv", env))
    assert engine(resource)["env"][-3:] == env
    stored = last_good_manifest(resource, resource.spec, owner_uid="u")
    spec = json.loads(stored["data"]["spec.json"])
    assert spec["engine"]["extraEnv"] == env  # the references, as written; the operator never reads a Secret
    assert set(stored["data"]) == {"spec.json"}


@pytest.mark.parametrize(
    ("served", "expected"), [(["v1", "v1beta1"], "policy/v1"), (["v1beta1"], "policy/v1beta1")]
)
async def test_the_served_policy_version_is_asked_once(served: list[str], expected: str) -> None:
    asked: list[str] = []
    versions = [{"groupVersion": f"policy/{version}", "version": version} for version in served]

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(200, json={"kind": "APIGroup", "name": "policy", "versions": versions})

    runtime = runtime_answering(handler, namespaces=())
    try:
        assert await runtime.policy_api_version() == expected
        assert await runtime.policy_api_version() == expected
    finally:
        await runtime.close()
    assert asked == ["/apis/policy"]
