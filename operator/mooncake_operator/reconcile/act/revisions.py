"""Writes the last good record (`decide.revisions.last_good_manifest`) with server-side apply."""

from __future__ import annotations

from mooncake_operator.api.group import FIELD_MANAGER
from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.api.spec import MooncakeServingSpec
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.reconcile.decide.revisions import last_good_manifest


async def write_last_good(
    kube: KubeClient, resource: MooncakeServing, spec: MooncakeServingSpec, *, owner_uid: str
) -> None:
    """Store `spec` as the last good revision (the planner decides when: it differs from the stored one)."""
    await kube.apply(last_good_manifest(resource, spec, owner_uid=owner_uid), field_manager=FIELD_MANAGER)
