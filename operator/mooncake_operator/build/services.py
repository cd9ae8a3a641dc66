"""The replicas' Services: the headless one (every replica addressable by name, ready or not, for the
canary) and the client Service (only replica pods a canary proved: label traffic=on).
"""

from __future__ import annotations

from typing import Any

from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.build.names import (
    COMPONENT_REPLICA,
    HTTP_PORT_NAME,
    ChildNames,
    Manifest,
    client_selector,
    labels,
    object_meta,
    service_selector,
)


def headless_service(resource: MooncakeServing, *, owner_uid: str | None) -> Manifest:
    names = ChildNames.of(resource.metadata.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(
            resource, names.headless_service, labels(resource, "vllm", COMPONENT_REPLICA), owner_uid
        ),
        "spec": {
            "clusterIP": "None",
            # Every replica stays addressable by name, ready or not, so the canary can reach each one.
            "publishNotReadyAddresses": True,
            "selector": service_selector(resource),
            "ports": [_http_service_port(resource)],
        },
    }


def client_service(resource: MooncakeServing, *, owner_uid: str | None) -> Manifest:
    names = ChildNames.of(resource.metadata.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(
            resource, names.client_service, labels(resource, "vllm", COMPONENT_REPLICA), owner_uid
        ),
        "spec": {
            "type": "ClusterIP",
            "selector": client_selector(resource.metadata.name),
            "ports": [_http_service_port(resource)],
        },
    }


def _http_service_port(resource: MooncakeServing) -> dict[str, Any]:
    port = resource.spec.engine.port
    return {"name": HTTP_PORT_NAME, "port": port, "targetPort": HTTP_PORT_NAME, "protocol": "TCP"}
