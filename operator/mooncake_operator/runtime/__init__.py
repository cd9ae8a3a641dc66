"""The operator process around the reconcile: its settings, its leader Lease, its Prometheus metrics and
the kopf handlers that start it all and hand every MooncakeServing event to the workers."""
