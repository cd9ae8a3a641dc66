"""The engine patcher at text level, on real upstream code read from released vLLM wheels.

vllm 0.22.1 (a CUDA build, so never imported here) carries the fix of PR #43516. Reverting its
coordinator to the pre-fix shape must give `buggy`, and `apply` must turn that back into code
equivalent to the upstream fix. vllm 0.21.0 has the store connector but no coordinator.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from tests.engine.patcher_support import (
    BUILD_SCRIPT,
    COORDINATOR_RELPATH,
    IMAGE_DIR,
    PATCHER,
    code_without_docstrings,
    load_patcher,
    make_vllm_dir,
    run_patcher,
    wheel_store_files,
)

from mooncake_sandbox.buggy_engine import reintroduce_double_prune, revert_to_prefix_shape

pytestmark = pytest.mark.unit

pc = load_patcher()
PYTHON = sys.executable  # the patcher is stdlib only: any Python 3.11+ runs status/apply


@pytest.fixture(scope="module")
def upstream_0_22_1() -> str:
    return wheel_store_files("0.22.1")["coordinator.py"].decode("utf-8")


@pytest.fixture
def prefix_shape(upstream_0_22_1: str) -> bytes:
    return revert_to_prefix_shape(upstream_0_22_1).encode("utf-8")


def snapshot(path: Path) -> tuple[bytes, int, int]:
    info = path.stat()
    return path.read_bytes(), info.st_mtime_ns, info.st_mode


# --- classification and the fix on the 0.22.1 release --------------------------------------


def test_released_0_22_1_says_fixed_upstream(upstream_0_22_1: str) -> None:
    assert pc.classify(upstream_0_22_1.encode()).state == pc.FIXED_UPSTREAM


def test_prefix_shape_has_no_apply_eagle_anywhere_and_is_buggy(prefix_shape: bytes) -> None:
    assert b"apply_eagle" not in prefix_shape
    assert b"self.eagle_attn_group_indices" in prefix_shape
    shape = pc.classify(prefix_shape)
    assert shape.state == pc.BUGGY
    assert "pre-fix" in shape.detail


def test_patching_the_prefix_shape_gives_the_upstream_fix(upstream_0_22_1: str, prefix_shape: bytes) -> None:
    patched = pc.patch_source(prefix_shape)
    assert pc.classify(patched).state == pc.PATCHED
    assert code_without_docstrings(patched) == code_without_docstrings(upstream_0_22_1)
    assert code_without_docstrings(prefix_shape) != code_without_docstrings(upstream_0_22_1)


def test_patching_the_double_prune_regression_gives_the_upstream_fix(upstream_0_22_1: str) -> None:
    regressed = reintroduce_double_prune(upstream_0_22_1).encode()
    assert b"apply_eagle=False" not in regressed
    assert pc.classify(regressed).state == pc.BUGGY
    patched = pc.patch_source(regressed)
    assert pc.classify(patched).state == pc.PATCHED
    assert code_without_docstrings(patched) == code_without_docstrings(upstream_0_22_1)


def test_patch_source_leaves_fixed_sources_alone(upstream_0_22_1: str, prefix_shape: bytes) -> None:
    assert pc.patch_source(upstream_0_22_1.encode()) == upstream_0_22_1.encode()
    patched = pc.patch_source(prefix_shape)
    assert pc.patch_source(patched) == patched


def test_explicit_apply_eagle_true_in_load_mask_is_buggy(upstream_0_22_1: str) -> None:
    explicit = upstream_0_22_1.replace("apply_eagle=False", "apply_eagle=True").encode()
    assert pc.classify(explicit).state == pc.BUGGY
    patched = pc.patch_source(explicit)
    assert code_without_docstrings(patched) == code_without_docstrings(upstream_0_22_1)


UNKNOWN_SHAPES = {
    "partly fixed: lookup gated, hit finder not": lambda s: s.replace(
        "eagle_indices = self.eagle_attn_group_indices if apply_eagle else set()",
        "eagle_indices = self.eagle_attn_group_indices",
    ),
    "load_mask passes a variable": lambda s: s.replace("apply_eagle=False", "apply_eagle=self.use_eagle"),
    "no Eagle group selection": lambda s: s.replace("eagle_attn_group_indices", "draft_groups"),
    "class renamed": lambda s: s.replace("class MooncakeStoreCoordinator", "class StoreCoordinator"),
    "not Python": lambda s: s + "\ndef broken(:\n",
}


@pytest.mark.parametrize("mutation", UNKNOWN_SHAPES, ids=list(UNKNOWN_SHAPES))
def test_unknown_shapes_are_classified_unknown(upstream_0_22_1: str, mutation: str) -> None:
    mutated = UNKNOWN_SHAPES[mutation](upstream_0_22_1)
    assert mutated != upstream_0_22_1
    assert pc.classify(mutated.encode()).state == pc.UNKNOWN


# --- the command line on a scratch vllm directory -------------------------------------------


def test_status_apply_status_on_the_prefix_shape(tmp_path: Path, prefix_shape: bytes) -> None:
    vllm = make_vllm_dir(tmp_path, prefix_shape)
    before = run_patcher(PYTHON, "status", "--vllm-dir", str(vllm))
    assert (before.returncode, before.stdout) == (1, "buggy\n")

    applied = run_patcher(PYTHON, "apply", "--vllm-dir", str(vllm))
    assert applied.returncode == 0, applied.stderr
    assert applied.stdout == "patched\n"

    after = run_patcher(PYTHON, "status", "--vllm-dir", str(vllm))
    assert (after.returncode, after.stdout) == (0, "patched\n")
    assert pc.MARKER in (vllm / COORDINATOR_RELPATH).read_text()


def test_apply_twice_changes_nothing_the_second_time(tmp_path: Path, prefix_shape: bytes) -> None:
    vllm = make_vllm_dir(tmp_path, prefix_shape)
    assert run_patcher(PYTHON, "apply", "--vllm-dir", str(vllm)).returncode == 0
    coordinator = vllm / COORDINATOR_RELPATH
    first = snapshot(coordinator)
    inode = coordinator.stat().st_ino
    second = run_patcher(PYTHON, "apply", "--vllm-dir", str(vllm))
    assert second.returncode == 0
    assert second.stdout == "patched\n"
    assert "nothing to do" in second.stderr
    assert snapshot(coordinator) == first
    assert coordinator.stat().st_ino == inode  # not even rewritten


def test_apply_on_fixed_upstream_is_a_no_op(tmp_path: Path, upstream_0_22_1: str) -> None:
    vllm = make_vllm_dir(tmp_path, upstream_0_22_1.encode())
    coordinator = vllm / COORDINATOR_RELPATH
    before = snapshot(coordinator)
    result = run_patcher(PYTHON, "apply", "--vllm-dir", str(vllm))
    assert (result.returncode, result.stdout) == (0, "fixed-upstream\n")
    assert snapshot(coordinator) == before


def test_apply_removes_stale_bytecode_keeps_mode_and_leaves_no_temp_files(
    tmp_path: Path, prefix_shape: bytes
) -> None:
    vllm = make_vllm_dir(tmp_path, prefix_shape)
    coordinator = vllm / COORDINATOR_RELPATH
    coordinator.chmod(0o640)
    cache = coordinator.parent / "__pycache__"
    cache.mkdir()
    stale = [cache / "coordinator.cpython-311.pyc", cache / "coordinator.cpython-312.opt-1.pyc"]
    other = cache / "data.cpython-311.pyc"
    for path in [*stale, other]:
        path.write_bytes(b"stale")
    listing_before = sorted(p.name for p in coordinator.parent.iterdir())

    assert run_patcher(PYTHON, "apply", "--vllm-dir", str(vllm)).returncode == 0

    assert not any(path.exists() for path in stale)
    assert other.exists()  # only the coordinator's bytecode goes
    assert stat.S_IMODE(coordinator.stat().st_mode) == 0o640
    assert sorted(p.name for p in coordinator.parent.iterdir()) == listing_before


@pytest.mark.parametrize("mutation", UNKNOWN_SHAPES, ids=list(UNKNOWN_SHAPES))
def test_unknown_shape_is_refused_and_left_byte_identical(
    tmp_path: Path, upstream_0_22_1: str, mutation: str
) -> None:
    vllm = make_vllm_dir(tmp_path, UNKNOWN_SHAPES[mutation](upstream_0_22_1).encode())
    coordinator = vllm / COORDINATOR_RELPATH
    before = snapshot(coordinator)

    status = run_patcher(PYTHON, "status", "--vllm-dir", str(vllm))
    assert (status.returncode, status.stdout) == (2, "unknown\n")

    refused = run_patcher(PYTHON, "apply", "--vllm-dir", str(vllm))
    assert refused.returncode == 2
    assert "refusing to patch" in refused.stderr
    assert "Expected" in refused.stderr and "Found:" in refused.stderr
    assert "unchanged" in refused.stderr
    assert snapshot(coordinator) == before


def test_read_only_file_gives_a_clear_error_and_stays_untouched(tmp_path: Path, prefix_shape: bytes) -> None:
    vllm = make_vllm_dir(tmp_path, prefix_shape)
    coordinator = vllm / COORDINATOR_RELPATH
    coordinator.chmod(0o444)
    before = snapshot(coordinator)
    result = run_patcher(PYTHON, "apply", "--vllm-dir", str(vllm))
    assert result.returncode == 3
    assert "read-only" in result.stderr and "chmod u+w" in result.stderr
    assert snapshot(coordinator) == before
    assert sorted(p.name for p in coordinator.parent.iterdir()) == ["coordinator.py"]


def test_unwritable_directory_gives_a_clear_error(tmp_path: Path, prefix_shape: bytes) -> None:
    vllm = make_vllm_dir(tmp_path, prefix_shape)
    coordinator = vllm / COORDINATOR_RELPATH
    before = snapshot(coordinator)
    store = coordinator.parent
    apply = [PYTHON, str(PATCHER), "apply", "--vllm-dir", str(vllm)]
    if os.geteuid() == 0:  # root ignores directory modes: make the directory a read-only mount
        mount = f'mount --bind {store} {store} && mount -o remount,ro,bind {store} && exec "$@"'
        command = ["unshare", "-m", "sh", "-c", mount, "sh", *apply]
    else:
        store.chmod(0o555)
        command = apply
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    finally:
        store.chmod(0o755)
    assert result.returncode == 3, result.stderr
    assert "cannot write" in result.stderr and "Nothing was changed" in result.stderr
    assert snapshot(coordinator) == before


# --- vLLM without a coordinator, and locating vLLM ------------------------------------------


def test_0_21_0_has_the_connector_but_no_coordinator_and_says_unknown(tmp_path: Path) -> None:
    files = wheel_store_files("0.21.0")
    assert "connector.py" in files and "coordinator.py" not in files
    vllm = make_vllm_dir(tmp_path, None, files)
    status = run_patcher(PYTHON, "status", "--vllm-dir", str(vllm))
    assert (status.returncode, status.stdout) == (2, "unknown\n")
    assert "predates MooncakeStoreCoordinator" in status.stderr
    applied = run_patcher(PYTHON, "apply", "--vllm-dir", str(vllm))
    assert applied.returncode == 2
    assert "refusing to patch" in applied.stderr
    assert not (vllm / COORDINATOR_RELPATH).exists()


def test_vllm_is_located_without_importing_it(tmp_path: Path, prefix_shape: bytes) -> None:
    vllm = make_vllm_dir(tmp_path, prefix_shape)
    (vllm / "__init__.py").write_text("raise RuntimeError('the patcher imported vllm')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = run_patcher(PYTHON, "status", env=env)
    assert (result.returncode, result.stdout) == (1, "buggy\n"), result.stderr
    assert str(vllm / COORDINATOR_RELPATH) in result.stderr


def test_missing_vllm_is_an_environment_error(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    located = run_patcher(PYTHON, "status", env=env)
    if located.returncode != 3:  # this Python has a vLLM of its own; the explicit path still counts
        assert "vllm" in located.stderr
    else:
        assert "vLLM is not installed" in located.stderr and located.stdout == ""
    result = run_patcher(PYTHON, "apply", "--vllm-dir", str(tmp_path / "nowhere"))
    assert result.returncode == 3
    assert "not a directory" in result.stderr
    (tmp_path / "plain").mkdir()
    result = run_patcher(PYTHON, "status", "--vllm-dir", str(tmp_path / "plain"))
    assert result.returncode == 3
    assert "no __init__.py" in result.stderr


# --- the image -------------------------------------------------------------------------------


def test_dockerfile_pins_the_base_and_runs_the_tested_build_script() -> None:
    dockerfile = (IMAGE_DIR / "Dockerfile").read_text()
    base = re.search(r"^ARG VLLM_IMAGE=(\S+)$", dockerfile, re.MULTILINE)
    assert base is not None
    assert re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+", base.group(1)), base.group(1)
    assert re.search(r"^FROM \$\{VLLM_IMAGE\}$", dockerfile, re.MULTILINE)
    assert re.search(r"^ARG MOONCAKE_PACKAGE=auto$", dockerfile, re.MULTILINE)
    assert re.search(r"^ARG CUDA_MAJOR=\d+$", dockerfile, re.MULTILINE)
    copy = r"^COPY patch_connector\.py check_linkage\.py build-engine\.sh /opt/mooncake-operator/$"
    assert re.search(copy, dockerfile, re.MULTILINE)
    joined = dockerfile.replace("\\\n", " ")  # continuation lines
    runs = re.findall(r"^RUN (.*)$", joined, re.MULTILINE)
    assert len(runs) == 1, "all build steps live in build-engine.sh, which the tests run"
    assert "/opt/mooncake-operator/build-engine.sh" in runs[0]
    assert '--expect-state "${ENGINE_PATCH_STATE}"' in runs[0]
    assert '--mooncake "${MOONCAKE_PACKAGE}"' in runs[0]
    assert '--expect-cuda-major "${CUDA_MAJOR}"' in runs[0]
    assert 'engine-patch-state="${ENGINE_PATCH_STATE}"' in dockerfile
    assert 'cuda-major="${CUDA_MAJOR}"' in dockerfile
    assert 'mooncake-package="${MOONCAKE_PACKAGE}"' in dockerfile


def test_build_script_rejects_a_bad_expected_state(tmp_path: Path) -> None:
    result = subprocess.run(
        ["sh", str(BUILD_SCRIPT), "--expect-state", "buggy", "--state-file", str(tmp_path / "state")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1
    assert "--expect-state must be fixed-upstream or patched" in result.stderr
    assert not (tmp_path / "state").exists()


def test_build_script_refuses_before_patching_when_the_label_would_lie(
    tmp_path: Path, prefix_shape: bytes
) -> None:
    vllm = make_vllm_dir(tmp_path, prefix_shape)
    coordinator = vllm / COORDINATOR_RELPATH
    before = snapshot(coordinator)
    command = ["sh", str(BUILD_SCRIPT), "--python", PYTHON, "--vllm-dir", str(vllm)]
    command += ["--expect-state", "fixed-upstream", "--state-file", str(tmp_path / "etc" / "state")]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1
    assert "ENGINE_PATCH_STATE=patched" in result.stderr
    assert snapshot(coordinator) == before
    assert not (tmp_path / "etc").exists()


def test_build_script_stops_on_an_unknown_shape(tmp_path: Path, upstream_0_22_1: str) -> None:
    unknown = UNKNOWN_SHAPES["partly fixed: lookup gated, hit finder not"](upstream_0_22_1).encode()
    vllm = make_vllm_dir(tmp_path, unknown)
    before = snapshot(vllm / COORDINATOR_RELPATH)
    state_file = tmp_path / "etc" / "state"
    result = subprocess.run(
        [
            "sh",
            str(BUILD_SCRIPT),
            "--python",
            PYTHON,
            "--vllm-dir",
            str(vllm),
            "--state-file",
            str(state_file),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1
    assert "refusing to patch" in result.stderr and "apply failed" in result.stderr
    assert snapshot(vllm / COORDINATOR_RELPATH) == before
    assert not state_file.exists()


# --- verify's guards (the behavioural check itself needs vLLM: tests/engine) ------------------


def test_verify_without_an_importable_coordinator_is_an_environment_error(tmp_path: Path) -> None:
    vllm = make_vllm_dir(tmp_path, None)
    result = run_patcher(PYTHON, "verify", "--vllm-dir", str(vllm))
    assert result.returncode == 3
    assert "cannot import vllm.distributed.kv_transfer" in result.stderr


def test_verify_refuses_to_vouch_for_a_coordinator_imported_from_elsewhere(tmp_path: Path) -> None:
    """A vllm whose import machinery resolves the coordinator from another tree must not pass."""
    elsewhere = tmp_path / "elsewhere" / "vllm"
    for package in [elsewhere, *[elsewhere / p for p in COORDINATOR_RELPATH.parents][:-1]]:
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").write_text("")
    (elsewhere / COORDINATOR_RELPATH).write_text("")
    vllm = make_vllm_dir(tmp_path / "given", b"")
    (vllm / "__init__.py").write_text(f"__path__.insert(0, {str(elsewhere)!r})\n")
    result = run_patcher(PYTHON, "verify", "--vllm-dir", str(vllm))
    assert result.returncode == 3
    assert f"imported {elsewhere / COORDINATOR_RELPATH}" in result.stderr
    assert "prove nothing" in result.stderr


def test_verify_fails_when_the_coordinator_cannot_run_the_scenarios(tmp_path: Path) -> None:
    vllm = tmp_path / "vllm"
    for package in [vllm, *[vllm / p for p in COORDINATOR_RELPATH.parents][:-1]]:
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").write_text("")
    (vllm / COORDINATOR_RELPATH).write_text("class MooncakeStoreCoordinator:\n    pass\n")
    result = run_patcher(PYTHON, "verify", "--vllm-dir", str(vllm))
    assert result.returncode == 1, result.stderr
    assert result.stdout.count("  FAIL  ") == 3 and "raised" in result.stdout
    assert "verify: FAILED" in result.stdout
