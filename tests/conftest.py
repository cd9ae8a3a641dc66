"""Fixtures shared by tiers. `node_cluster` lives here so the node tier and the fault tier share one
cluster when they run in one session (scripts/test runs a subset of the fault tier before the node
tier on the same cluster: it saves a cluster start and a first canary in CI)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tests.support import cluster, kube_node


@pytest.fixture(scope="session")
def node_cluster() -> Iterator[kube_node.Images]:
    """scripts/cluster's single node, the models bound, the chart installed; stopped afterwards.
    Needs root and the images built by scripts/build-images."""
    with cluster.node_with_operator() as images:
        yield images
