"""A reasoning variant of the tiny target: it thinks, writes `</think>`, then answers, as MiniMax-M2.5 does.

Standalone script: it runs with the ENGINE venv's python (torch, tokenizers, safetensors, transformers)
and imports nothing from this package but its sibling generator `tiny_models.py` (same directory).

    python reasoning_model.py OUTPUT_DIR PROBE_REQUEST_JSON

MiniMax-M2.5's chat template opens the think block (`<think>\\n` after the assistant's header) and the
model writes only `</think>` before its answer; vLLM's `minimax_m2` reasoning parser reads it that way
(everything before the first `</think>` token is reasoning, everything after is content). This model
does the same:

- its tokenizer is trained as the tiny target's, with `<think>` and `</think>` as single tokens of the
  vocabulary (ids 3 and 4; not special, so they stay in the text without a parser, like MiniMax's);
- its chat template ends the generation prompt with `<think>\\n`;
- its weights are the tiny target's revision 1 (the same seeded draws) but for two rows of `lm_head`:
  `<think>`'s is zero (never written, like the special tokens) and `</think>`'s is a scaled unit
  direction d. Its logit is then `scale * (h . d)` for the final hidden state h, a score every step
  has: the model writes `</think>` at the first step where that score beats the greedy token's logit,
  and again wherever it does later.

d and the scale are chosen on the probe request (the reference conversation, PROBE_REQUEST_JSON: the
sandbox passes it) by greedy decoding with transformers on the CPU, in bf16 as the engine runs: d is the
prompt's mean hidden state (every hidden state leans on it, so the score is positive at every step), or
that tilted by one of a few seeded random vectors; the scale puts the first win at a step k in
[MIN_REASONING, MAX_REASONING] with the widest margin, at least MIN_MARGIN, over k's own threshold and
every earlier step's. The stored bf16 row is checked to do the same. k is early on purpose: another
engine's kernels follow the same greedy path only so far (vLLM CPU first left transformers' at step 21
of the reference request), and a margin of 15% is far above their numeric noise. Other prompts end
their reasoning wherever their score first wins; a short budget may end inside it (which is what a
reasoning model's canary must cope with). Same inputs, byte-identical output; the choice is written to
OUTPUT_DIR/reasoning.json.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tiny_models as tiny  # type: ignore[import-not-found]  # the sibling generator: same corpus, seeds
import torch  # type: ignore[import-not-found]  # engine venv only
from safetensors.torch import save_file  # type: ignore[import-not-found]
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # type: ignore[import-not-found]

THINK_START, THINK_END = "<think>", "</think>"
# Ids 0-2 the tiny target's special tokens, 3-4 the think markers (trained in this order).
VOCAB_TOKENS = [*tiny.SPECIAL_TOKENS, THINK_START, THINK_END]
THINK_START_ID, THINK_END_ID = VOCAB_TOKENS.index(THINK_START), VOCAB_TOKENS.index(THINK_END)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)
# Reasoning length on the probe, in tokens: a few words of reasoning, early enough that another engine
# is still on transformers' greedy path (see above).
MIN_REASONING = 8
MAX_REASONING = 16
# `</think>` must outscore the greedy token at its step, and fall short at every earlier one, by this
# factor at least: a near tie another engine's bf16 kernels could break the other way is no choice (the
# top logits are 3-6 nats; 15% of them is 0.45-0.9 nat, where the engines' noise is a few hundredths).
MIN_MARGIN = 1.15
DIRECTIONS = 16
TILT = 0.5
REPORT = "reasoning.json"


def train_tokenizer() -> Tokenizer:
    """The tiny target's tokenizer with the think markers as tokens of their own (not special)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=tiny.VOCAB_SIZE,
        special_tokens=VOCAB_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(tiny.corpus(random.Random(tiny.SEED)), trainer)
    if tokenizer.get_vocab_size() != tiny.VOCAB_SIZE:
        raise SystemExit(
            f"tokenizer trained to {tokenizer.get_vocab_size()} tokens, expected {tiny.VOCAB_SIZE}"
        )
    # The trainer registers its special tokens as special; the markers must stay in decoded text (a
    # client without a reasoning parser sees `…</think>answer`, as with MiniMax-M2.5).
    state = json.loads(tokenizer.to_str())
    for added in state["added_tokens"]:
        if added["content"] in (THINK_START, THINK_END):
            added["special"] = False
    return Tokenizer.from_str(json.dumps(state))


def tokenizer_config() -> dict[str, object]:
    config: dict[str, object] = tiny.tokenizer_config()
    added: dict[str, Any] = {
        str(index): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in tiny.SPECIAL_TOKENS,
        }
        for index, token in enumerate(VOCAB_TOKENS)
    }
    return {**config, "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE}


def base_weights() -> dict[str, torch.Tensor]:
    """Revision 1's weights with both think markers silent (zero rows: never the greedy choice)."""
    tensors: dict[str, torch.Tensor] = tiny.target_weights(1)
    tensors["lm_head.weight"][: len(VOCAB_TOKENS)] = 0
    return tensors


def with_think_end_row(tensors: dict[str, torch.Tensor], row: torch.Tensor) -> dict[str, torch.Tensor]:
    head = tensors["lm_head.weight"].clone()
    head[THINK_END_ID] = row.to(head.dtype)
    return {**tensors, "lm_head.weight": head}


def write(directory: Path, tokenizer: Tokenizer, tensors: dict[str, torch.Tensor]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tiny.write_json(directory / "config.json", tiny.target_config())
    tiny.write_json(directory / "tokenizer_config.json", tokenizer_config())
    tokenizer.save(str(directory / "tokenizer.json"))
    save_file(tensors, str(directory / "model.safetensors"))


@dataclass
class Trace:
    """One greedy decoding of the probe: per answer step the token, the top logit and the final hidden
    state (the RMSNorm output `lm_head` multiplies); and the mean hidden state over the prompt."""

    answer: list[int]
    top_logits: list[float]
    hidden: list[torch.Tensor]
    prompt_mean: torch.Tensor


class Probe:
    """Greedy decoding of the probe request with transformers, in the engine's dtype (bf16)."""

    def __init__(self, directory: Path, request: dict[str, Any]) -> None:
        from transformers import AutoTokenizer  # type: ignore[import-not-found]

        tokenizer = AutoTokenizer.from_pretrained(str(directory))
        rendered = tokenizer.apply_chat_template(
            request["messages"], add_generation_prompt=True, tokenize=False
        )
        if not rendered.endswith(f"assistant\n{THINK_START}\n"):
            raise SystemExit(f"the chat template does not open the think block: {rendered[-40:]!r}")
        self.directory = directory
        self.prompt: list[int] = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        self.max_tokens = int(request["max_tokens"])

    def run(self, tensors: dict[str, torch.Tensor]) -> Trace:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig.from_pretrained(str(self.directory))).to(torch.bfloat16).eval()
        model.load_state_dict(tensors)
        normed: list[torch.Tensor] = []
        model.model.norm.register_forward_hook(lambda _module, _inputs, output: normed.append(output[0]))
        ids = list(self.prompt)
        trace = Trace(answer=[], top_logits=[], hidden=[], prompt_mean=torch.zeros(0))
        with torch.no_grad():
            for _ in range(self.max_tokens):
                normed.clear()
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                if not trace.answer:
                    trace.prompt_mean = normed[-1].float().mean(dim=0)
                trace.answer.append(int(logits.argmax()))
                trace.top_logits.append(float(logits.max()))
                trace.hidden.append(normed[-1][-1].float())
                ids.append(trace.answer[-1])
        return trace


def scales_to_win(trace: Trace, direction: torch.Tensor) -> list[float]:
    """Per step, the scale of `direction` from which a `</think>` row of it outscores the greedy token."""
    scales = []
    for top, hidden in zip(trace.top_logits, trace.hidden, strict=True):
        along = float(hidden @ direction)
        scales.append(top / along if along > 0 and top > 0 else math.inf)
    return scales


def directions(trace: Trace) -> list[torch.Tensor]:
    """Unit directions to try: the prompt's mean hidden state (every step's hidden state leans on it), then
    the same tilted by seeded random unit vectors."""
    mean = trace.prompt_mean / trace.prompt_mean.norm()
    generator = torch.Generator().manual_seed(tiny.SEED + 7)
    tilted = []
    for _ in range(DIRECTIONS - 1):
        noise = torch.randn(mean.shape[0], generator=generator)
        mixed = mean + TILT * noise / noise.norm()
        tilted.append(mixed / mixed.norm())
    return [mean, *tilted]


def choose_think_end_row(
    probe: Probe, tensors: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, Any]]:
    """`</think>`'s lm_head row: the direction and scale that make it the greedy token first at a step k in
    [MIN_REASONING, MAX_REASONING] of the probe, by the widest margin over every earlier step."""
    trace = probe.run(tensors)
    # (margin, direction index, step, scale): the scale sits midway (geometrically) between the step's
    # own threshold and the lowest earlier one, so both sides keep the same factor.
    candidates: list[tuple[float, int, int, float]] = []
    units = directions(trace)
    for index, direction in enumerate(units):
        scales = scales_to_win(trace, direction)
        for step in range(MIN_REASONING, min(MAX_REASONING, len(scales) - 2) + 1):
            earlier = min(scales[:step])
            if scales[step] < earlier:
                margin = earlier / scales[step]
                candidates.append((margin, index, step, scales[step] * math.sqrt(margin)))
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    for margin, index, step, scale in candidates:
        if margin < MIN_MARGIN:
            break
        row = (units[index] * scale).to(torch.bfloat16)
        answer = probe.run(with_think_end_row(tensors, row)).answer
        # The stored bf16 row must do what the float one promised: the first `</think>` at `step`.
        if THINK_END_ID in answer and answer.index(THINK_END_ID) == step:
            return row, {
                "direction": index,
                "scale": scale,
                "margin": margin,
                "probe_reasoning_tokens": step,
                "probe_think_ends": answer.count(THINK_END_ID),
                "probe_prompt_tokens": len(probe.prompt),
            }
    raise SystemExit(
        f"no direction makes `</think>` first win between answer steps {MIN_REASONING} and {MAX_REASONING} "
        f"of the probe by a factor of {MIN_MARGIN}; change the bounds or the seed"
    )


def generate(output: Path, request: dict[str, Any]) -> dict[str, Any]:
    staging = output.with_name(output.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    tokenizer = train_tokenizer()
    tensors = base_weights()
    write(staging, tokenizer, tensors)
    probe = Probe(staging, request)
    row, report = choose_think_end_row(probe, tensors)
    report.update({"think_start_id": THINK_START_ID, "think_end_id": THINK_END_ID})
    save_file(with_think_end_row(tensors, row), str(staging / "model.safetensors"))
    tiny.write_json(staging / REPORT, report)
    staging.rename(output)
    return report


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python reasoning_model.py OUTPUT_DIR PROBE_REQUEST_JSON", file=sys.stderr)
        return 2
    output = Path(argv[0])
    if output.exists():
        print(f"{output} already exists; remove it first", file=sys.stderr)
        return 2
    try:
        request = json.loads(argv[1])
        if not (isinstance(request["messages"], list) and int(request["max_tokens"]) > MAX_REASONING + 1):
            raise ValueError(f"max_tokens must exceed {MAX_REASONING + 1}")
    except (ValueError, KeyError, TypeError) as error:
        print(f"PROBE_REQUEST_JSON must be a chat request (messages, max_tokens): {error}", file=sys.stderr)
        return 2
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    print(json.dumps(generate(output, request), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
