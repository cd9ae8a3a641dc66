"""A copy of the tiny target whose logits differ from the original's by a bounded, deterministic amount.

Standalone script: it runs with the ENGINE venv's python (torch, safetensors) and imports nothing
from this package. It stands in for the numerics of another GPU (or of a cached prefix computed in
another reduction order): the reader serves this copy, the writer the original, and their logits
differ by at most BOUND nats at every position, which is what GPU drift looks like to the canary.

    python perturbed_model.py SOURCE_TARGET_DIR OUTPUT_DIR BOUND_NATS

Why the weights and not a vLLM logits processor: vLLM 0.32 refuses custom `--logits-processors`
when a speculative config is set (the reference Eagle-3 deployment, where the bug lives).

What changes: only `lm_head.weight`, row i plus a seeded random vector n_i. Every layer before it,
and so every KV block, is the original's: a block the writer stores is exactly the block the reader
would compute. The logit of token i moves by h . n_i, where h is the final RMSNorm's output;
|h| < max|g| * sqrt(hidden) (g the norm's weight), so |n_i| <= BOUND / (max|g| * sqrt(hidden))
bounds every logit's move by BOUND (Cauchy-Schwarz), before the bf16 rounding of the weights and of
the logits. The bound is recomputed on the stored bf16 weights (`effective_bound_nats`) and written,
with the typical move, to OUTPUT_DIR/perturbation.json. Rows of the special tokens stay zero (the
original's: the model never stops early). Same inputs, byte-identical output.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import torch  # type: ignore[import-not-found]  # engine venv only
from safetensors.torch import load_file, save_file  # type: ignore[import-not-found]

SEED = 4351600  # vLLM PR #43516
WEIGHTS = "model.safetensors"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"
REPORT = "perturbation.json"


def perturb(tensors: dict[str, torch.Tensor], bound: float) -> dict[str, float]:
    """Perturb `tensors[LM_HEAD]` in place; returns the bounds and sizes as measured on the result."""
    head = tensors[LM_HEAD]
    gain = float(tensors[FINAL_NORM].float().abs().max())
    vocab, hidden = head.shape
    norm_limit = bound / (gain * math.sqrt(hidden))
    generator = torch.Generator().manual_seed(SEED)
    directions = torch.randn(vocab, hidden, generator=generator, dtype=torch.float32)
    directions /= directions.norm(dim=1, keepdim=True)
    original = head.float()
    live = original.abs().sum(dim=1) > 0  # zero rows (special tokens) stay zero
    noise = directions * norm_limit * live.unsqueeze(1)
    stored = (original + noise).to(head.dtype)
    tensors[LM_HEAD] = stored
    moved = stored.float() - original  # what the engine will really multiply with
    row_norms = moved.norm(dim=1)
    return {
        "bound_nats": bound,
        # Cauchy-Schwarz on the stored weights; bf16 rounding of h adds at most 2^-8 of it.
        "effective_bound_nats": float(row_norms.max()) * gain * math.sqrt(hidden) * (1 + 2**-8),
        # For an h spread evenly over its dimensions, a logit moves by about |n_i| * max|g|.
        "typical_move_nats": float(row_norms[live].pow(2).mean().sqrt()) * gain,
        "rows_changed": int((row_norms > 0).sum()),
        "seed": SEED,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python perturbed_model.py SOURCE_TARGET_DIR OUTPUT_DIR BOUND_NATS", file=sys.stderr)
        return 2
    source, output, bound_text = Path(argv[0]), Path(argv[1]), argv[2]
    try:
        bound = float(bound_text)
    except ValueError:
        print(f"BOUND_NATS must be a number, got {bound_text!r}", file=sys.stderr)
        return 2
    if not (math.isfinite(bound) and bound > 0):
        print(f"BOUND_NATS must be a positive number of nats, got {bound}", file=sys.stderr)
        return 2
    if output.exists():
        print(f"{output} already exists; remove it first", file=sys.stderr)
        return 2
    torch.use_deterministic_algorithms(True)
    staging = output.with_name(output.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging)
    tensors = load_file(str(source / WEIGHTS))
    report = perturb(tensors, bound)
    save_file(tensors, str(staging / WEIGHTS))
    (staging / REPORT).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    staging.rename(output)
    print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
