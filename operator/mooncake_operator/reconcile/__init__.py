"""Orchestration of a MooncakeServing: apply children, readiness, canary, status (kopf-free).

`reconcile(runtime, namespace, name)` is what each resource's worker (`reconcile.worker`, started from
kopf's watch events) calls; it reads from the watch cache (`reconcile.cache`). The modules below it are
pure where they can be (children diffing, readiness, canary planning, status) and tested as such.
"""

from mooncake_operator.reconcile.actions import Outcome
from mooncake_operator.reconcile.core import Runtime, reconcile
from mooncake_operator.runtime.metrics import ReconcileResult

__all__ = ["Outcome", "ReconcileResult", "Runtime", "reconcile"]
