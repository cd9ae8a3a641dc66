"""The tiny target and Eagle-3 draft, generated once per generator version and cached.

The cache directory is named by the hash of `tiny_models.py`, so editing the generator gives a new
model set and never reuses stale weights. Derived models (the perturbed target, the reasoning target)
live under it, keyed by their own generator's hash and inputs.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
from dataclasses import dataclass
from pathlib import Path

from mooncake_operator.canary.request import reference_request
from mooncake_sandbox.engine_env import EngineEnv, Log
from mooncake_sandbox.errors import SandboxSetupError

GENERATOR = Path(__file__).with_name("tiny_models.py")
PERTURBATION_GENERATOR = Path(__file__).with_name("perturbed_model.py")
REASONING_GENERATOR = Path(__file__).with_name("reasoning_model.py")
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


@dataclass(frozen=True)
class PerturbedTarget:
    """A copy of the tiny target whose logits move by at most `bound_nats` (perturbed_model.py)."""

    path: Path  # its basename is `target`, as the original's: vLLM keys the store by it
    bound_nats: float
    effective_bound_nats: float  # recomputed on the stored bf16 weights
    typical_move_nats: float

    def describe(self) -> str:
        return (
            f"lm_head perturbed: every logit moves by at most {self.effective_bound_nats:.3g} nats "
            f"(asked {self.bound_nats:g}; typical {self.typical_move_nats:.2g}), KV unchanged; stands in "
            "for another GPU's numerics (sandbox only)"
        )


def check_bound(bound_nats: float) -> float:
    if not (math.isfinite(bound_nats) and 0 < bound_nats <= 10):
        raise ValueError(f"the perturbation bound must be between 0 and 10 nats, got {bound_nats}")
    return bound_nats


def perturbed_dir(models: TinyModels, bound_nats: float) -> Path:
    """Cached per (tiny models, generator version, bound); the leaf is named `target`."""
    digest = hashlib.sha256(PERTURBATION_GENERATOR.read_bytes()).hexdigest()[:16]
    return models.root / "perturbed" / f"{digest}-{check_bound(bound_nats)!r}" / "target"


def ensure_perturbed_target(
    env: EngineEnv, models: TinyModels, bound_nats: float, *, log: Log
) -> PerturbedTarget:
    """The perturbed copy of revision 1's target, generated once per bound with the engine's python."""
    path = perturbed_dir(models, bound_nats)
    report = path / "perturbation.json"
    if not report.exists():
        log(f"generating the tiny target with logits perturbed by at most {bound_nats:g} nats into {path}")
        path.parent.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            [str(env.python), str(PERTURBATION_GENERATOR), str(models.target), str(path), repr(bound_nats)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            tail = "\n".join(result.stdout.splitlines()[-30:])
            raise SandboxSetupError(f"perturbing the tiny target failed (exit {result.returncode}):\n{tail}")
    facts = json.loads(report.read_text())
    return PerturbedTarget(
        path=path,
        bound_nats=float(facts["bound_nats"]),
        effective_bound_nats=float(facts["effective_bound_nats"]),
        typical_move_nats=float(facts["typical_move_nats"]),
    )


@dataclass(frozen=True)
class ReasoningTarget:
    """The tiny target's reasoning variant (reasoning_model.py): its chat template opens `<think>`, the
    model writes `</think>` and then its answer, as MiniMax-M2.5 does for vLLM's `minimax_m2` parser."""

    path: Path  # its own basename: the store never mixes its blocks with the plain target's
    think_end_id: int
    probe_reasoning_tokens: int  # where the reference request ends its reasoning (greedy, transformers)

    def describe(self) -> str:
        return (
            f"reasoning variant of the target ({self.path.name}): template opens <think>, the model writes "
            f"</think> (id {self.think_end_id}) then answers; {self.probe_reasoning_tokens} reasoning tokens "
            "on the reference request (sandbox only)"
        )


def probe_request_json() -> str:
    """The request the reasoning generator sizes the reasoning on (canary/request.py)."""
    return json.dumps(reference_request(), sort_keys=True)


def reasoning_dir(models: TinyModels) -> Path:
    """Cached per (tiny models, reasoning generator version, probe request)."""
    hasher = hashlib.sha256(REASONING_GENERATOR.read_bytes())
    hasher.update(probe_request_json().encode())
    return models.root / "reasoning" / hasher.hexdigest()[:16] / "reasoning-target"


def ensure_reasoning_target(env: EngineEnv, models: TinyModels, *, log: Log) -> ReasoningTarget:
    """The reasoning variant of the tiny target, generated once with the engine's python (~15 s)."""
    path = reasoning_dir(models)
    report = path / "reasoning.json"
    if not report.exists():
        log(f"generating the tiny reasoning target into {path}")
        path.parent.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            [str(env.python), str(REASONING_GENERATOR), str(path), probe_request_json()],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            tail = "\n".join(result.stdout.splitlines()[-30:])
            raise SandboxSetupError(
                f"generating the tiny reasoning target failed (exit {result.returncode}):\n{tail}"
            )
    facts = json.loads(report.read_text())
    return ReasoningTarget(
        path=path,
        think_end_id=int(facts["think_end_id"]),
        probe_reasoning_tokens=int(facts["probe_reasoning_tokens"]),
    )
