"""The node tier: the product as shipped, on a real single-node Kubernetes (scripts/cluster's machinery).

One cluster per session: kubelet, containerd, kube-proxy, kube-scheduler, the control plane and the DNS
stand-in in a private network namespace (tests/support/kube_node.py), the chart `helm install`ed with
the operator image built here and the tiny models on a local PersistentVolume. The pytest process
joins that namespace. Prerequisites are built by scripts/test (or scripts/cluster up); a missing one
fails with the command that provides it. Needs root.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.support import cluster, kube_node

NODE_DIR = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if NODE_DIR in item.path.parents:
            item.add_marker(pytest.mark.node)


@pytest.fixture(scope="session")
def node_cluster() -> Iterator[kube_node.Images]:
    with cluster.node_with_operator() as images:
        yield images
