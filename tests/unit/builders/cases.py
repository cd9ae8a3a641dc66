"""The resources the builders' golden tests render: the customer's deployment and variants that together
use every builder branch (shared by tests/unit/test_render.py's whole-render goldens and the per-module
goldens in this folder)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from mooncake_operator.api.examples import reference_deployment, reference_deployment_yaml
from mooncake_operator.api.resource import MooncakeServing, parse_resource

RDMA_EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "minimax-m2.5-eagle3-rdma.yaml"
OWNER_UID = "5b0c1d7e-0000-4000-8000-000000000001"


def example_dict() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(reference_deployment_yaml())
    return loaded


def small_variant() -> MooncakeServing:
    """Everything the example does not use: PVC cache, no Eagle, rdma, no canary, one replica, extras."""
    obj = example_dict()
    obj["metadata"] = {"name": "small", "namespace": "serving"}
    spec = obj["spec"]
    del spec["speculative"]
    spec["replicas"] = 1
    spec["canary"] = {"enabled": False}
    spec["model"] = {"name": "org/model", "cache": {"existingClaim": "hf-cache"}}
    spec["engine"] = {
        "image": "engine:1",
        "extraArgs": ["--enable-prompt-embeds"],
        "extraEnv": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
        "sharedMemorySize": "16Gi",
        "port": 8080,
    }
    spec["store"] = {
        "protocol": "rdma",
        "deviceName": "mlx5_0",
        "globalSegmentSize": "512MB",
        "localBufferSize": "128MB",
        "loadAsync": False,
        "loadFailurePolicy": "recompute",
        "master": {"image": "master:1", "rpcPort": 6000, "metricsPort": 6001},
        # /dev/infiniband from the node, the host network, the runtime's memlock limit
        "rdma": {"hostDevices": True, "hostNetwork": True, "memlock": "Runtime"},
    }
    spec["engine"]["extraEnv"].append(
        {"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "api", "optional": True}}}
    )
    spec["imagePullSecrets"] = [{"name": "regcred"}]
    spec["podMetadata"] = {"labels": {"team": "a"}, "annotations": {"example.com/owner": "team-a"}}
    spec["networkPolicy"] = {
        "operator": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}},
        "clients": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}],
    }
    return parse_resource(obj)


def ha_managed() -> MooncakeServing:
    """The customer's deployment with highly available masters and the operator-run etcd (3 members)."""
    obj = example_dict()
    ha = {"enabled": True, "etcd": {"managed": {"replicas": 3}}}
    obj["spec"]["store"]["master"]["highAvailability"] = ha
    return parse_resource(obj)


def ha_external_tls() -> MooncakeServing:
    """Highly available masters electing through the user's etcd over https (CA from a Secret)."""
    obj = example_dict()
    obj["spec"]["store"]["master"]["highAvailability"] = {
        "enabled": True,
        "replicas": 5,
        "enableOplog": False,
        "etcd": {
            "external": {
                "endpoints": ["etcd-0.etcd.infra.svc:2379", "etcd-1.etcd.infra.svc:2379"],
                "tls": {"caSecretRef": {"name": "etcd-ca"}},
            }
        },
    }
    return parse_resource(obj)


def rdma_example() -> MooncakeServing:
    """examples/minimax-m2.5-eagle3-rdma.yaml: RDMA device plugin, Multus, per-replica claims, placement."""
    return parse_resource(yaml.safe_load(RDMA_EXAMPLE.read_text(encoding="utf-8")))


CASES = {
    "minimax-m2.5-eagle3": reference_deployment,
    "small-variant": small_variant,
    "ha-managed-etcd": ha_managed,
    "ha-external-etcd-tls": ha_external_tls,
    "minimax-m2.5-eagle3-rdma": rdma_example,
}
