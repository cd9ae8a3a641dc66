"""Shared by the Mooncake linkage tests: the checker as a module, and the cached wheels and vLLM
evidence that `images/vllm-mooncake/fetch-linkage-evidence.sh` downloads (tests run offline)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from mooncake_sandbox.engine_env import cache_root

REPO = Path(__file__).resolve().parents[2]
IMAGE_DIR = REPO / "images" / "vllm-mooncake"
CHECKER = IMAGE_DIR / "check_linkage.py"
FETCH_SCRIPT = IMAGE_DIR / "fetch-linkage-evidence.sh"
RELEASE = "0.3.13.post1"
# CUDA major -> the wheel's file-name prefix, for the three Mooncake builds the image chooses from.
MOONCAKE_WHEELS = {
    "12": "mooncake_transfer_engine",
    "13": "mooncake_transfer_engine_cuda13",
    "none": "mooncake_transfer_engine_non_cuda",
}


def load_checker() -> ModuleType:
    """The stdlib-only checker as a module (it lives in the image directory, not the package)."""
    loaded = sys.modules.get("check_linkage")
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location("check_linkage", CHECKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_linkage"] = module  # dataclasses look their module up while executing
    spec.loader.exec_module(module)
    return module


def _missing(what: str, where: Path) -> None:
    pytest.fail(
        f"{what} is not in {where}; run {FETCH_SCRIPT.relative_to(REPO)} --python {sys.executable} "
        "(scripts/test does) with network access",
        pytrace=False,
    )


def cached_wheel(prefix: str, version: str) -> Path:
    wheels = sorted((cache_root() / "wheels").glob(f"{prefix}-{version}-*.whl"))
    if not wheels:
        _missing(f"the {prefix} {version} wheel", cache_root() / "wheels")
    return wheels[-1]


def mooncake_wheel(major: str) -> Path:
    return cached_wheel(MOONCAKE_WHEELS[major], RELEASE)


def vllm_0_32_0_evidence() -> Path:
    """METADATA and the small extension objects of the vllm 0.32.0 wheel (see the fetch script)."""
    evidence = cache_root() / "evidence" / "vllm-0.32.0"
    if not (evidence / "SOURCE").is_file():
        _missing("the vllm 0.32.0 evidence", evidence)
    return evidence


def extract(wheel: Path, dest: Path) -> Path:
    """The wheel unpacked into `dest` (a site-packages-like directory), file modes kept."""
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            path = Path(archive.extract(info, dest))
            mode = info.external_attr >> 16
            if mode:
                path.chmod(mode & 0o777)
    return dest


def run_checker(
    python: Path | str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), str(CHECKER), *args], capture_output=True, text=True, check=False, env=env, timeout=300
    )
