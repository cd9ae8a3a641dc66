"""The reconcile's I/O: the watch cache, the pass that reads a snapshot and carries out the decided
actions in order (apply, status, events, traffic labels, set removal, the canary run), the masters'
/health probe, and the per-resource workers.
"""
