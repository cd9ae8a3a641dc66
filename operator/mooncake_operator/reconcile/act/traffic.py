"""User traffic: the client Service selects replica pods labelled `traffic: on`.

Pods start `off` (the pod template says so); `plan` decides which serve and this module only writes the
label. The pod template is never touched for traffic, so no rollout is triggered; a held pod stays
reachable through the headless Service, so the next canary can prove it.
"""

from __future__ import annotations

from collections.abc import Mapping

from mooncake_operator.api.group import FIELD_MANAGER
from mooncake_operator.build.names import TRAFFIC_LABEL, TRAFFIC_ON
from mooncake_operator.kube.client import KubeClient


async def set_traffic(kube: KubeClient, namespace: str, labels: Mapping[str, str]) -> None:
    """Pod name -> traffic label value, one merge patch per pod: pods going in first, so a BlueGreen
    switch never leaves the client Service empty."""
    for name, value in sorted(labels.items(), key=lambda item: (item[1] != TRAFFIC_ON, item[0])):
        patch = {"metadata": {"labels": {TRAFFIC_LABEL: value}}}
        await kube.patch_merge("v1", "Pod", name, patch, namespace, field_manager=FIELD_MANAGER)
