"""The fault tier: faults injected on the node tier's real pods under a steady client load
(tests/support/fault_load.py). One cluster per session, the node tier's (`node_cluster`, in
tests/conftest.py); the scenarios run in file order on one MooncakeServing, each starting from Ready.
Needs root; run it with scripts/test-faults. The machine's CPU stalls are watched
(tests/support/cpu_stalls.py) and each scenario's measurements list those during it: evidence for a
failure, never a rerun."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.support import cluster, kube_node
from tests.support.cpu_stalls import cpu_stall_monitor, cpu_stall_watch  # noqa: F401 (fixtures)
from tests.support.kube_node import kubectl

FAULTS_DIR = Path(__file__).parent
NAME = "minimax-m25"
FIRST_VERDICT_TIMEOUT = 1200.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if FAULTS_DIR in item.path.parents:
            item.add_marker(pytest.mark.faults)


@pytest.fixture(scope="session")
def serving(node_cluster: kube_node.Images) -> str:
    """The customer's resource (CPU variant, patched engine) Ready: every scenario starts from here."""
    kubectl(["apply", "-f", "-"], input=json.dumps(cluster.example_resource(node_cluster.engine_patched)))
    verdict = cluster.wait_for_verdict(NAME, FIRST_VERDICT_TIMEOUT)
    assert verdict == "Ready", f"{NAME} ended {verdict} before any fault"
    return NAME
