"""Which perturbation bounds tip a near tie in the default suite, offline (no server), in seconds.

    PYTHONPATH=operator ~/.cache/mooncake-operator/engine-venv/bin/python \
        bench/perturbation_probe.py ~/.cache/mooncake-operator/models/<hash> 0.05 0.1 0.2

Runs with the ENGINE venv's python (torch, transformers); the first argument is the tiny models'
directory (`mooncake-operator sandbox prepare` prints it). Builds the default suite for block size 32
with the tiny target's own tokenizer (the chat template rendered as vLLM renders it), then decodes every
request greedily in bf16 with Hugging Face transformers: the tiny target, and its copy perturbed by each
bound (`sandbox/mooncake_sandbox/perturbed_model.py`, generated under /tmp if missing). Per request: the
first token where the two answers part, the tie gap there (in the original's distribution), and the
largest logprob drift of the shared tokens before it. transformers' CPU kernels are not vLLM's: this
chooses a bound to try; the e2e tier and bench/canary_numerics.py measure on the real engines.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch  # type: ignore[import-not-found]  # engine venv only
from transformers import AutoModelForCausalLM, AutoTokenizer  # type: ignore[import-not-found]

from mooncake_operator.canary.request import TokenCount, build_suite, reference_request, suite_cost

# Run as a script, not imported from mooncake_sandbox: that package is not on this PYTHONPATH, and it
# imports the operator's own dependencies, which the engine venv lacks.
PERTURBATION_GENERATOR = Path(__file__).resolve().parents[1] / "sandbox/mooncake_sandbox/perturbed_model.py"

BLOCK_SIZE = 32


def main(models: Path, bounds: list[float]) -> dict[str, Any]:
    target = models / "target"
    tokenizer = AutoTokenizer.from_pretrained(str(target))

    def encode(messages: list[dict[str, Any]]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    async def count(request: dict[str, Any]) -> TokenCount:
        return TokenCount(len(encode(request["messages"])), 4096)

    suite = asyncio.run(build_suite(reference_request(), count, block_size=BLOCK_SIZE))
    prompts = [(item.name, encode(item.request["messages"]), item.request["max_tokens"]) for item in suite]
    torch.set_num_threads(1)

    def decode(path: Path) -> dict[str, tuple[list[int], list[Any]]]:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
        answers = {}
        for name, ids, max_tokens in prompts:
            tokens, logprobs = [], []
            sequence = torch.tensor([ids])
            with torch.no_grad():
                for _ in range(max_tokens):
                    distribution = torch.log_softmax(model(sequence).logits[0, -1].float(), -1)
                    token = int(distribution.argmax())
                    tokens.append(token)
                    logprobs.append(distribution)
                    sequence = torch.cat([sequence, torch.tensor([[token]])], 1)
            answers[name] = (tokens, logprobs)
        return answers

    original = decode(target)
    report: dict[str, Any] = {
        "suite": [(item.name, item.prompt_tokens, item.request["max_tokens"]) for item in suite],
        "suite_cost_per_pair": suite_cost(suite).__dict__,
        "bounds": {},
    }
    for bound in bounds:
        copy = Path("/tmp/perturbation-probe") / repr(bound) / "target"
        if not copy.exists():
            subprocess.run(
                [sys.executable, str(PERTURBATION_GENERATOR), str(target), str(copy), repr(bound)],
                check=True,
                capture_output=True,  # its own report would mix with ours on stdout
            )
        perturbed = decode(copy)
        rows = []
        for name, (tokens, logprobs) in original.items():
            other_tokens, other_logprobs = perturbed[name]
            parted = next(
                (i for i, (a, b) in enumerate(zip(tokens, other_tokens, strict=True)) if a != b), None
            )
            shared = parted if parted is not None else len(tokens)
            drift = max(
                (abs(float(logprobs[i][tokens[i]] - other_logprobs[i][tokens[i]])) for i in range(shared)),
                default=0.0,
            )
            gap = None
            if parted is not None:
                gap = float(logprobs[parted][tokens[parted]] - logprobs[parted][other_tokens[parted]])
            rows.append({"request": name, "diverges_at": parted, "tie_gap_nats": gap, "drift_nats": drift})
        report["bounds"][repr(bound)] = rows
    return report


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: perturbation_probe.py MODELS_DIR [BOUND_NATS ...]")
    bounds = [float(arg) for arg in sys.argv[2:]] or [0.05, 0.1, 0.2]
    print(json.dumps(main(Path(sys.argv[1]), bounds), indent=2))
