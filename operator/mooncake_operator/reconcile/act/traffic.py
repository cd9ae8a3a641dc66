"""User traffic: the client Service selects replica pods labelled `traffic: on`.

Pods start `off` (the pod template says so); `plan` decides which serve and this module only writes the
label. The pod template is never touched for traffic, so no rollout is triggered; a held pod stays
reachable through the headless Service, so the next canary can prove it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from mooncake_operator.api.group import FIELD_MANAGER
from mooncake_operator.build.names import TRAFFIC_LABEL, TRAFFIC_ON
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.kube.errors import KubeApiError

logger = logging.getLogger(__name__)


async def set_traffic(
    kube: KubeClient, namespace: str, labels: Mapping[str, str], uids: Mapping[str, str]
) -> list[str]:
    """Pod name -> traffic label value, one merge patch per pod: pods going in first, so a BlueGreen
    switch never leaves the client Service empty. Returns the pods left alone because they are gone.

    Each patch carries the observed pod's uid, which the API server takes as a precondition (the uid is
    immutable: another pod under the name refuses the patch): a StatefulSet pod deleted and created
    again since the decision is a new, unproven instance and keeps its template's `off`. Its creation
    is a pod event, so the next reconcile decides about it.
    """
    gone = []
    for name, value in sorted(labels.items(), key=lambda item: (item[1] != TRAFFIC_ON, item[0])):
        patch = {"metadata": {"uid": uids[name], "labels": {TRAFFIC_LABEL: value}}}
        try:
            await kube.patch_merge("v1", "Pod", name, patch, namespace, field_manager=FIELD_MANAGER)
        except KubeApiError as error:
            if not (error.not_found or another_instance(error)):
                raise
            logger.info(
                "%s/%s: traffic %s not set: the observed pod (uid %s) is gone (%s)",
                namespace,
                name,
                value,
                uids[name],
                error.message,
            )
            gone.append(name)
    return gone


def another_instance(error: KubeApiError) -> bool:
    """The patch was refused because the name now belongs to another pod: 422 with the uid as the
    invalid field (what kube-apiserver 1.20 answers, measured in the cluster tier), or a 409 conflict."""
    if error.conflict:
        return True
    causes = error.details.get("causes") if error.status == 422 else None
    return isinstance(causes, list) and any(
        isinstance(cause, dict) and cause.get("field") == "metadata.uid" for cause in causes
    )
