"""The tiny target and Eagle-3 draft, generated once per generator version and cached.

The cache directory is named by the hash of `tiny_models.py`, so editing the generator gives a new
model set and never reuses stale weights.
"""

from __future__ import annotations

import hashlib
import subprocess
from dataclasses import dataclass
from pathlib import Path

from mooncake_operator.sandbox.engine_env import EngineEnv, Log
from mooncake_operator.sandbox.errors import SandboxSetupError

GENERATOR = Path(__file__).with_name("tiny_models.py")
TARGET_REVISIONS = (1, 2)  # tiny_models.REVISIONS (the generator runs in the engine venv, not imported)


@dataclass(frozen=True)
class TinyModels:
    root: Path

    @property
    def target(self) -> Path:
        return self.target_for(1)

    def target_for(self, revision: int) -> Path:
        """The target's weights at `revision` (1 or 2); same basename, so vLLM keys both alike."""
        if revision not in TARGET_REVISIONS:
            raise ValueError(f"the tiny target has revisions {TARGET_REVISIONS}, not {revision}")
        return self.root / "target" if revision == 1 else self.root / f"revision-{revision}" / "target"

    @property
    def draft(self) -> Path:
        return self.root / "draft"


def generator_digest() -> str:
    return hashlib.sha256(GENERATOR.read_bytes()).hexdigest()[:16]


def models_dir(cache: Path) -> Path:
    return cache / "models" / generator_digest()


def ensure_tiny_models(env: EngineEnv, cache: Path, *, log: Log) -> TinyModels:
    models = TinyModels(models_dir(cache))
    if (models.root / "manifest.json").exists():
        return models
    log(f"generating the tiny target + Eagle-3 draft into {models.root}")
    generate_models(env, models.root)
    return models


def generate_models(env: EngineEnv, output: Path) -> None:
    """Run the generator with the engine's python (it needs torch, tokenizers, safetensors)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [str(env.python), str(GENERATOR), str(output)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        tail = "\n".join(result.stdout.splitlines()[-30:])
        raise SandboxSetupError(f"generating the tiny models failed (exit {result.returncode}):\n{tail}")
