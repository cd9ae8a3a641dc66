"""The opt-in InferencePool (`inference.networking.k8s.io/v1`, Gateway API Inference Extension): the
standard front door of inference gateways. Its selector is the client Service's, traffic label included,
so a pod is a member only while a canary proves it (the label goes off before a restarted engine can be
Ready again); the endpoint picker the user names routes among the members.
"""

from __future__ import annotations

from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.build.names import COMPONENT_REPLICA, Manifest, client_selector, labels, object_meta

INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
INFERENCE_POOL_GROUP = "inference.networking.k8s.io"
INFERENCE_POOL_KIND = "InferencePool"


def inference_pool(resource: MooncakeServing, *, owner_uid: str | None) -> Manifest | None:
    """The InferencePool NAME, or None when spec.inferencePool is unset."""
    pool = resource.spec.inference_pool
    if pool is None:
        return None
    picker = pool.endpoint_picker
    reference: dict[str, object] = {"kind": picker.kind, "name": picker.name}
    if picker.group:
        reference["group"] = picker.group
    reference["port"] = {"number": picker.port}
    reference["failureMode"] = picker.failure_mode
    name = resource.metadata.name
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": INFERENCE_POOL_KIND,
        "metadata": object_meta(resource, name, labels(resource, "vllm", COMPONENT_REPLICA), owner_uid),
        "spec": {
            "selector": {"matchLabels": client_selector(name)},
            "targetPorts": [{"number": resource.spec.engine.port}],
            "endpointPickerRef": reference,
        },
    }
