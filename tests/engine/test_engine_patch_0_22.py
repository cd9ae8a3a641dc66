"""The patcher's behavioural check on vLLM 0.22.1's own code: the coordinator generation the
customer's kind of build (main before PR #43516) had.

The 0.22.1 wheel is a CUDA build, but the coordinator and everything it imports are Python: its
non-binary files, unpacked, run on the engine venv's torch and libraries (plus gguf, the one import
the engine venv lacks). No upstream file is committed; the wheels come from the cache that
images/vllm-mooncake/fetch-reference-wheels.sh fills.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from tests.engine.patcher_support import COORDINATOR_RELPATH, PATCHER, reference_wheel

from mooncake_sandbox.buggy_engine import make_buggy_overlay, revert_to_prefix_shape

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def vllm_0_22_1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """vllm 0.22.1's Python package (binary extensions left out), unpacked."""
    root = tmp_path_factory.mktemp("vllm-0.22.1")
    with reference_wheel("0.22.1") as wheel:
        members = [n for n in wheel.namelist() if n.startswith("vllm/") and not n.endswith(".so")]
        wheel.extractall(root, members)
    return root / "vllm"


@pytest.fixture(scope="module")
def extra_path(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gguf")
    with reference_wheel("0.19.0", project="gguf") as wheel:
        wheel.extractall(root)
    return {**os.environ, "PYTHONPATH": str(root)}


def patcher(python: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), str(PATCHER), *args], capture_output=True, text=True, check=False, env=env, timeout=300
    )


def test_released_0_22_1_verifies(engine_python: Path, vllm_0_22_1: Path, extra_path: dict[str, str]) -> None:
    status = patcher(engine_python, extra_path, "status", "--vllm-dir", str(vllm_0_22_1))
    assert (status.returncode, status.stdout) == (0, "fixed-upstream\n"), status.stderr
    result = patcher(engine_python, extra_path, "verify", "--vllm-dir", str(vllm_0_22_1))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "vLLM 0.22.1" in result.stdout and result.stdout.count("  ok  ") == 3


def test_pre_fix_0_22_shape_fails_both_eagle_checks_until_patched(
    tmp_path: Path, engine_python: Path, vllm_0_22_1: Path, extra_path: dict[str, str]
) -> None:
    overlay = make_buggy_overlay(vllm_0_22_1, tmp_path, transform=revert_to_prefix_shape) / "vllm"
    status = patcher(engine_python, extra_path, "status", "--vllm-dir", str(overlay))
    assert (status.returncode, status.stdout) == (1, "buggy\n"), status.stderr

    failed = patcher(engine_python, extra_path, "verify", "--vllm-dir", str(overlay))
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert str(overlay / COORDINATOR_RELPATH) in failed.stdout
    # In this generation the hybrid layout is hit too: no Eagle peek past the hit length.
    assert "FAIL  eagle, full attention: lookup hit 48 tokens, load_mask [[True, True]]" in failed.stdout
    assert "FAIL  eagle, full attention + sliding window" in failed.stdout
    assert "ok    no eagle, full attention" in failed.stdout

    applied = patcher(engine_python, extra_path, "apply", "--vllm-dir", str(overlay))
    assert (applied.returncode, applied.stdout) == (0, "patched\n"), applied.stderr
    passed = patcher(engine_python, extra_path, "verify", "--vllm-dir", str(overlay))
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert passed.stdout.count("  ok  ") == 3
