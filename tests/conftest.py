"""Fixtures shared by tiers. `node_cluster` lives here so the node tier and the fault tier share one
cluster when they run in one session (scripts/test runs a subset of the fault tier before the node
tier on the same cluster: it saves a cluster start and a first canary in CI)."""

from __future__ import annotations

import ast
import gc
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from tests.support import cluster, kube_node

# CI's CPython (3.11.7) keeps ast.parse's recursion count in interpreter-wide state (gh-106905):
# when another thread parses while one is inside ast.parse, the first raises "SystemError: AST
# constructor recursion depth mismatch". Python 3.11 parses whenever it formats a traceback (its
# carets), so a server thread's traceback landing while pytest formatted a failure turned that
# failure into an INTERNALERROR that ended the session and hid which test failed (CI, 5 December).
# A parse switches threads only when the garbage collector runs a finalizer inside it: with the
# collector off during the parse, and one parse at a time, no thread runs Python code in between.
_parse_lock = threading.RLock()
_unlocked_parse = ast.parse


def _parse_alone(*args: Any, **kwargs: Any) -> Any:
    with _parse_lock:
        collecting = gc.isenabled()
        gc.disable()
        try:
            return _unlocked_parse(*args, **kwargs)
        finally:
            if collecting:
                gc.enable()


ast.parse = _parse_alone


@pytest.fixture(scope="session")
def node_cluster() -> Iterator[kube_node.Images]:
    """scripts/cluster's single node, the models bound, the chart installed; stopped afterwards.
    Needs root and the images built by scripts/build-images."""
    with cluster.node_with_operator() as images:
        yield images
