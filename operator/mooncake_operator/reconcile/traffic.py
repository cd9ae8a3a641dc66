"""User traffic: the client Service selects replica pods labelled `traffic: on`.

After a failed canary the operator sets the label to `off` on the replicas the run blamed, so they keep
running (reachable through the headless Service for the next canary) but get no user requests. The pod
template is not touched, so no rollout is triggered; a pod recreated under a held name is held again.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from mooncake_operator import render
from mooncake_operator.kube import KubeClient
from mooncake_operator.operator_settings import FIELD_MANAGER
from mooncake_operator.reconcile.observe import PodInfo


def wanted_label(pod_name: str, held: Collection[str]) -> str:
    return render.TRAFFIC_OFF if pod_name in held else render.TRAFFIC_ON


def label_changes(pods: Sequence[PodInfo], held: Collection[str]) -> dict[str, str]:
    """Pod name -> the traffic label it must get (only pods whose label differs; terminating ones skipped)."""
    return {
        pod.name: wanted_label(pod.name, held)
        for pod in pods
        if not pod.terminating and pod.traffic != wanted_label(pod.name, held)
    }


async def sync_traffic(
    kube: KubeClient, namespace: str, pods: Sequence[PodInfo], held: Collection[str]
) -> dict[str, str]:
    changes = label_changes(pods, held)
    for name, value in changes.items():
        patch = {"metadata": {"labels": {render.TRAFFIC_LABEL: value}}}
        await kube.patch_merge("v1", "Pod", name, patch, namespace, field_manager=FIELD_MANAGER)
    return changes
