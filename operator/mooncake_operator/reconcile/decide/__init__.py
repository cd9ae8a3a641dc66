"""The reconcile's pure decisions: from a snapshot of what was read, what to render, what the status says,
who serves users, whether the canary runs, what to write, when to look again. No Kubernetes client, no
httpx, no kopf (tests/unit/test_layers.py holds every module here to it); tested on exact output.
"""
