"""Fixtures shared by the engine tier (tests that run real vLLM code from the engine venv)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mooncake_sandbox.engine_env import cache_root


@pytest.fixture(scope="module")
def engine_python() -> Path:
    python = cache_root() / "engine-venv" / "bin" / "python"
    if not python.exists():
        pytest.fail(
            f"engine venv missing ({python}); create it with `mooncake-operator sandbox prepare`",
            pytrace=False,
        )
    return python
