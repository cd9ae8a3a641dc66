"""The e2e tier: real mooncake_master and real vLLM CPU replicas, inside a loopback-only network namespace.

vLLM's Mooncake store clients listen on 0.0.0.0 whatever they are told, so these tests refuse to run
on a shared network: they fail (never skip) with the command that runs them in a private namespace.
"""

from __future__ import annotations

import pytest
from tests.support.cpu_stalls import cpu_stall_monitor, cpu_stall_watch  # noqa: F401 (fixtures)

from mooncake_sandbox import EngineMode, Prepared, prepare
from mooncake_sandbox.netns import in_private_netns

RUN_IN_NETNS = ".venv/bin/python -m mooncake_sandbox.netns -- .venv/bin/python -m pytest -m e2e"


@pytest.fixture(scope="session", autouse=True)
def private_network_namespace() -> None:
    if not in_private_netns():
        pytest.fail(
            "the e2e tier starts servers whose store clients listen on 0.0.0.0; run it in a loopback-only "
            f"network namespace: {RUN_IN_NETNS}  (scripts/test does this for every tier)"
        )


@pytest.fixture(scope="session")
def prepared() -> Prepared:
    """Engine venv, tiny models, both engine overlays (normally already done by `sandbox prepare`)."""
    return prepare(tuple(EngineMode), log=lambda line: print(f"prepare: {line}"))
