"""Which vLLM code the replicas run: the pre-fix (buggy) coordinator, or that same code after our patcher.

Both are private overlays prepended to PYTHONPATH; the installed vLLM is never edited. `patched` is
built exactly the way the engine image fixes a user's main-branch build: start from the buggy
coordinator and run `images/vllm-mooncake/patch_connector.py apply` on it.
"""

from __future__ import annotations

import enum
import hashlib
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from mooncake_sandbox.buggy_engine import make_buggy_overlay, revert_to_prefix_shape
from mooncake_sandbox.engine_env import EngineEnv, Log
from mooncake_sandbox.errors import SandboxSetupError

PATCHER_RELPATH = Path("images/vllm-mooncake/patch_connector.py")


class EngineMode(enum.StrEnum):
    PATCHED = "patched"
    BUGGY = "buggy"


# What the patcher's `status` must print for each mode before a replica may use the overlay.
EXPECTED_STATUS = {EngineMode.BUGGY: "buggy", EngineMode.PATCHED: "patched"}


@dataclass(frozen=True)
class EngineBuild:
    mode: EngineMode
    pythonpath: Path  # prepend to the replica's PYTHONPATH
    vllm_dir: Path  # the overlay's `vllm` package
    patcher_status: str  # the one word `patch_connector.py status` prints
    patcher_detail: str  # its explanation (stderr)


def patcher_script() -> Path:
    """The patcher shipped in the engine image, from this checkout."""
    repo = Path(__file__).resolve().parents[2]  # sandbox/mooncake_sandbox/engines.py
    script = repo / PATCHER_RELPATH
    if not script.is_file():
        raise SandboxSetupError(
            f"the engine patcher {PATCHER_RELPATH} is not at {script}: run the sandbox from a checkout of "
            "the repository (it ships the patcher the engine image uses)"
        )
    return script


def prepare_engine(env: EngineEnv, mode: EngineMode, cache: Path, *, log: Log) -> EngineBuild:
    """The overlay for `mode`, built once per (installed vLLM, overlay code, patcher) and cached."""
    installed = env.vllm_package_dir()
    patcher = patcher_script()
    root = cache / "engines" / f"{mode.value}-{_digest(installed, patcher)}"
    ready = root / "READY"
    if not ready.exists():
        log(f"building the {mode.value} engine overlay in {root}")
        _build(env, mode, installed, patcher, root)
    pythonpath = Path(ready.read_text().strip())
    vllm_dir = pythonpath / "vllm"
    status, detail = patcher_status(env, patcher, vllm_dir)
    if status != EXPECTED_STATUS[mode]:
        raise SandboxSetupError(
            f"the {mode.value} engine overlay {vllm_dir} has patcher status {status!r}, "
            f"expected {EXPECTED_STATUS[mode]!r} ({detail}); delete {root} and run again"
        )
    return EngineBuild(
        mode=mode, pythonpath=pythonpath, vllm_dir=vllm_dir, patcher_status=status, patcher_detail=detail
    )


def patcher_status(env: EngineEnv, patcher: Path, vllm_dir: Path) -> tuple[str, str]:
    """(state, explanation) as `patch_connector.py status` reports them."""
    result = _patcher(env, patcher, "status", vllm_dir)
    words = result.stdout.split()
    detail = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
    # The explanation starts with the file's path; the overlay's location says nothing new.
    detail = detail.split(": ", 1)[-1]
    return (words[0] if words else f"(no status; exit {result.returncode})"), detail


def _build(env: EngineEnv, mode: EngineMode, installed: Path, patcher: Path, root: Path) -> None:
    # Built in place; READY, written last, is what makes a directory usable.
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    # The pre-fix shape of main (before vLLM PR #43516): the reference deployment's kind of build.
    pythonpath = make_buggy_overlay(installed, root / "overlay", transform=revert_to_prefix_shape)
    if mode is EngineMode.PATCHED:
        applied = _patcher(env, patcher, "apply", pythonpath / "vllm")
        if applied.returncode != 0:
            raise SandboxSetupError(
                f"patch_connector.py apply failed on the buggy overlay (exit {applied.returncode}):\n"
                f"{applied.stdout}{applied.stderr}"
            )
    (root / "READY").write_text(f"{pythonpath}\n")


def _patcher(env: EngineEnv, patcher: Path, command: str, vllm_dir: Path) -> subprocess.CompletedProcess[str]:
    # The engine's python, as in the image: `verify` imports the real coordinator.
    return subprocess.run(
        [str(env.python), str(patcher), command, "--vllm-dir", str(vllm_dir)],
        capture_output=True,
        text=True,
        check=False,
    )


def _digest(installed: Path, patcher: Path) -> str:
    import mooncake_sandbox.buggy_engine as overlay_code

    hasher = hashlib.sha256()
    hasher.update(str(installed).encode())
    hasher.update((installed / "__init__.py").read_bytes())
    hasher.update(Path(overlay_code.__file__).read_bytes())
    hasher.update(patcher.read_bytes())
    return hasher.hexdigest()[:16]
