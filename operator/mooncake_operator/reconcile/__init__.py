"""The reconcile of a MooncakeServing, kopf-free: `decide/` holds the pure decisions (no Kubernetes client,
no httpx: a unit test holds them to it), `act/` the I/O that reads their inputs and carries them out.

Each resource's worker (`act.worker`, started from kopf's watch events) calls `act.core.reconcile`, which
reads from the watch cache (`act.cache`), has `decide.choose` pick what to render, applies it, observes,
and carries out `decide.plan.decide`'s actions in order.
"""
