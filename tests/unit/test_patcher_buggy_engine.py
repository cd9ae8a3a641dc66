"""The buggy-engine builder: transforms on real upstream text, and the overlay package that
shadows a vLLM install without touching it (text level: a vllm tree made from the 0.22.1 wheel)."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest
from tests.engine.patcher_support import (
    COORDINATOR_RELPATH,
    code_without_docstrings,
    load_patcher,
    make_vllm_dir,
    run_patcher,
    wheel_store_files,
)

from mooncake_sandbox.buggy_engine import (
    OVERLAY_STAMP,
    BuggyEngineError,
    make_buggy_overlay,
    reintroduce_double_prune,
    revert_to_prefix_shape,
)

pytestmark = pytest.mark.unit

pc = load_patcher()


@pytest.fixture(scope="module")
def store_files() -> dict[str, bytes]:
    return wheel_store_files("0.22.1")


@pytest.fixture
def installed(tmp_path: Path, store_files: dict[str, bytes]) -> Path:
    """A stand-in for an installed vllm package, with bytecode next to its coordinator."""
    vllm = make_vllm_dir(tmp_path / "site-packages", store_files["coordinator.py"], store_files)
    (vllm / "v1").mkdir()
    (vllm / "v1" / "__init__.py").write_text("")
    cache = (vllm / COORDINATOR_RELPATH).parent / "__pycache__"
    cache.mkdir()
    (cache / "coordinator.cpython-311.pyc").write_bytes(b"original bytecode")
    return vllm


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under root by content, and every symlink by target."""
    digest = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            digest[key] = "-> " + os.readlink(path)
        elif path.is_file():
            digest[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digest


def test_transforms_refuse_sources_that_are_not_fixed(store_files: dict[str, bytes]) -> None:
    fixed = store_files["coordinator.py"].decode()
    regressed = reintroduce_double_prune(fixed)
    with pytest.raises(BuggyEngineError, match="apply_eagle=False"):
        reintroduce_double_prune(regressed)
    prefix = revert_to_prefix_shape(fixed)
    with pytest.raises(BuggyEngineError, match="not a fixed coordinator"):
        revert_to_prefix_shape(prefix)
    with pytest.raises(BuggyEngineError, match="MooncakeStoreCoordinator"):
        reintroduce_double_prune("x = 1\n")


def test_revert_accepts_the_double_prune_shape_too(store_files: dict[str, bytes]) -> None:
    fixed = store_files["coordinator.py"].decode()
    from_regressed = revert_to_prefix_shape(reintroduce_double_prune(fixed))
    assert code_without_docstrings(from_regressed) == code_without_docstrings(revert_to_prefix_shape(fixed))


def test_overlay_shadows_the_coordinator_and_links_the_rest(tmp_path: Path, installed: Path) -> None:
    root = make_buggy_overlay(installed, tmp_path / "overlay")
    assert root == (tmp_path / "overlay").resolve()
    overlay = root / "vllm"
    coordinator = overlay / COORDINATOR_RELPATH
    assert coordinator.is_file() and not coordinator.is_symlink()
    assert pc.classify(coordinator.read_bytes()).state == pc.BUGGY
    # real directories only along the path to coordinator.py, symlinks everywhere else
    real_dirs = [overlay, *[overlay / p for p in COORDINATOR_RELPATH.parents][:-1]]
    assert all(d.is_dir() and not d.is_symlink() for d in real_dirs)
    assert (overlay / "v1").is_symlink() and (overlay / "__init__.py").is_symlink()
    assert (coordinator.parent / "connector.py").resolve() == (
        installed / COORDINATOR_RELPATH
    ).parent / "connector.py"
    assert not any(d.name == "__pycache__" for d in overlay.rglob("*"))
    assert (overlay / OVERLAY_STAMP).is_file()


def test_patching_the_overlay_never_touches_the_install(tmp_path: Path, installed: Path) -> None:
    before = tree_digest(installed)
    root = make_buggy_overlay(installed, tmp_path / "overlay", transform=revert_to_prefix_shape)
    overlay = root / "vllm"
    cache = (overlay / COORDINATOR_RELPATH).parent / "__pycache__"
    cache.mkdir()  # as a first import would create it
    (cache / "coordinator.cpython-311.pyc").write_bytes(b"overlay bytecode")

    result = run_patcher(sys.executable, "apply", "--vllm-dir", str(overlay))
    assert result.returncode == 0, result.stderr
    assert run_patcher(sys.executable, "status", "--vllm-dir", str(overlay)).stdout == "patched\n"
    assert not (cache / "coordinator.cpython-311.pyc").exists()
    assert tree_digest(installed) == before
    assert run_patcher(sys.executable, "status", "--vllm-dir", str(installed)).stdout == "fixed-upstream\n"


def test_overlay_rebuilds_in_place(tmp_path: Path, installed: Path) -> None:
    make_buggy_overlay(installed, tmp_path / "overlay", transform=revert_to_prefix_shape)
    run_patcher(sys.executable, "apply", "--vllm-dir", str(tmp_path / "overlay" / "vllm"))
    make_buggy_overlay(installed, tmp_path / "overlay")
    coordinator = tmp_path / "overlay" / "vllm" / COORDINATOR_RELPATH
    assert pc.classify(coordinator.read_bytes()).state == pc.BUGGY
    assert "pre-fix" not in pc.classify(coordinator.read_bytes()).detail
    assert [p.name for p in (tmp_path / "overlay").iterdir()] == ["vllm"]  # no staging left behind


def test_overlay_refuses_to_replace_a_real_package_or_overlap_the_install(
    tmp_path: Path, installed: Path
) -> None:
    with pytest.raises(BuggyEngineError, match="overlap"):
        make_buggy_overlay(installed, installed.parent)
    with pytest.raises(BuggyEngineError, match="overlap"):
        make_buggy_overlay(installed, installed / "inside")
    assert not (installed / "inside").exists()
    foreign = tmp_path / "elsewhere" / "vllm"
    foreign.mkdir(parents=True)
    (foreign / "__init__.py").write_text("")
    with pytest.raises(BuggyEngineError, match="not an overlay made here"):
        make_buggy_overlay(installed, tmp_path / "elsewhere")
    assert (foreign / "__init__.py").exists()
    with pytest.raises(BuggyEngineError, match="not a vllm package"):
        make_buggy_overlay(tmp_path / "elsewhere", tmp_path / "overlay")
