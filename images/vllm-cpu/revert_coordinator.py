"""Build step of images/vllm-cpu/Containerfile (runs inside the image, with the venv's python).

Rewrites the installed vLLM's MooncakeStore coordinator into its pre-fix shape (vLLM PR #43516
reverted, with the same transform the sandbox uses: mooncake_sandbox.buggy_engine, copied into the
build context by scripts/build-images) and, with --alias-dist, records a `vllm` distribution alias
for vllm-cpu so `vllm serve` can read its own version.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import sysconfig
from pathlib import Path

import buggy_engine  # type: ignore[import-not-found]  # next to this file in the image


def vllm_dir() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("revert_coordinator: vllm is not installed in this python")
    return Path(spec.origin).parent


def write_alias(requirement: str) -> None:
    name, _, version = requirement.partition("==")
    if name == "vllm":
        return
    if not version:
        raise SystemExit(f"revert_coordinator: --alias-dist needs NAME==VERSION, not {requirement!r}")
    dist = Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        f"Summary: alias of {name} {version} (the same vllm package), for `vllm --version`\n"
    )
    (dist / "INSTALLER").write_text("mooncake-operator images/vllm-cpu\n")
    print(f"revert_coordinator: {dist.name} aliases {name} {version}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--alias-dist", metavar="NAME==VERSION")
    args = parser.parse_args()
    coordinator = vllm_dir() / buggy_engine.COORDINATOR_RELPATH
    coordinator.write_text(buggy_engine.revert_to_prefix_shape(coordinator.read_text()))
    for stale in coordinator.parent.glob(f"__pycache__/{coordinator.stem}.*"):
        stale.unlink()
    print(f"revert_coordinator: {coordinator} now has the pre-fix shape")
    if args.alias_dist:
        write_alias(args.alias_dist)
    return 0


if __name__ == "__main__":
    sys.exit(main())
