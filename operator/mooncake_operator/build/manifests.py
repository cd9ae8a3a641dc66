"""Every child of a resource in apply order (`render_all`), and manifests as one readable YAML
stream.
"""

from __future__ import annotations

import yaml

from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.build.disruption import POLICY_V1, pod_disruption_budget
from mooncake_operator.build.inference_pool import inference_pool
from mooncake_operator.build.master import master_children
from mooncake_operator.build.names import Manifest
from mooncake_operator.build.network_policy import DEFAULT_OPERATOR_NAMESPACE, network_policies
from mooncake_operator.build.replicas import ReplicaTemplate, replica_stateful_set
from mooncake_operator.build.services import client_service, headless_service
from mooncake_operator.build.store_config import store_config_map
from mooncake_operator.safe_yaml import NoAliasDumper


def render_all(
    resource: MooncakeServing,
    *,
    owner_uid: str | None,
    policy_api_version: str = POLICY_V1,
    replica_set: str | None = None,
    operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE,
    open_http_by_default: bool = True,
    template: ReplicaTemplate | None = None,
    replicas: int | None = None,
    partition: int | None = None,
) -> list[Manifest]:
    """Every child object, in apply order: network policies first (so no pod starts unprotected),
    config and master, replicas next, services and the disruption budget for them, then the
    InferencePool when asked for.

    `policy_api_version`: the PodDisruptionBudget's apiVersion the cluster serves (`policy/v1` from
    Kubernetes 1.21 on; the operator asks the API server which one it serves). `replica_set`: the
    replica StatefulSet rendered from this spec (a BlueGreen candidate's name); another set (the one
    serving during a BlueGreen rollout) is not rendered, so it is left as it runs. `operator_namespace`:
    where the operator's pods run, the only namespace its NetworkPolicy peer admits.
    `open_http_by_default`: whether the replicas' HTTP port admits anyone when no clients are listed.
    `template`: the replica pod template, when the caller already rendered it (`ReplicaTemplate.of`).
    `replicas`, `partition`: the replica StatefulSet's, as the operator's rollout step asks."""
    return [
        *network_policies(
            resource,
            owner_uid=owner_uid,
            operator_namespace=operator_namespace,
            open_http_by_default=open_http_by_default,
        ),
        store_config_map(resource, owner_uid=owner_uid),
        *master_children(resource, owner_uid=owner_uid),
        headless_service(resource, owner_uid=owner_uid),
        replica_stateful_set(
            resource,
            owner_uid=owner_uid,
            replica_set=replica_set,
            template=template,
            replicas=replicas,
            partition=partition,
        ),
        client_service(resource, owner_uid=owner_uid),
        pod_disruption_budget(resource, owner_uid=owner_uid, api_version=policy_api_version),
        *([pool] if (pool := inference_pool(resource, owner_uid=owner_uid)) is not None else []),
    ]


class _ManifestDumper(NoAliasDumper):
    """Readable manifests: multi-line strings (the store config) as literal blocks."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_ManifestDumper.add_representer(str, _represent_str)


def to_yaml_stream(manifests: list[Manifest]) -> str:
    """Manifests as one YAML stream ("---"-separated documents), keys in builder order."""
    return yaml.dump_all(manifests, Dumper=_ManifestDumper, sort_keys=False, explicit_start=True, width=120)
