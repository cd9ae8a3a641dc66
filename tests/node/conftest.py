"""The node tier: the product as shipped, on a real single-node Kubernetes (scripts/cluster's machinery).

One cluster per session: kubelet, containerd, kube-proxy, kube-scheduler, the control plane and the DNS
stand-in in a private network namespace (tests/support/kube_node.py), the chart `helm install`ed with
the operator image built here and the tiny models on a local PersistentVolume. The pytest process
joins that namespace (the session fixture `node_cluster`, in tests/conftest.py). Prerequisites are
built by scripts/test (or scripts/cluster up); a missing one fails with the command that provides it.
Needs root.
"""

from __future__ import annotations

from pathlib import Path

import pytest

NODE_DIR = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if NODE_DIR in item.path.parents:
            item.add_marker(pytest.mark.node)
