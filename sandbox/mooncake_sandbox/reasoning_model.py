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
- its weights are the tiny target's revision 1 (the same seeded draws), with one change in `lm_head`:
  `</think>` takes over the row of one ordinary token X, whose own row becomes zero. The model therefore
  writes `</think>` exactly where it would have written X, and never writes X. `<think>` is silent, as
  the special tokens are.

X is chosen on the probe request (the customer's conversation, PROBE_REQUEST_JSON: the sandbox passes
it), by greedy decoding with transformers on this machine's CPU: the token at the latest step k in
[MIN_REASONING, MAX_REASONING] that is the first occurrence of its token, that lies before the probe's
first near tie (a top-2 gap under SAFE_GAP_NATS, where another engine's numerics could pick another
token), and after which `</think>` appears exactly once in the probe's answer. So on the probe the
reasoning is k tokens long and the answer follows within the request's budget; other prompts end their
reasoning wherever the model would have written X (a short budget may end inside it, which is what a
reasoning model's canary must cope with). Same inputs, byte-identical output; the choice is written to
OUTPUT_DIR/reasoning.json.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
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
# Reasoning length on the probe, in tokens: beyond the default suite's 32-token budget when it can be
# (those answers then end inside the reasoning), inside the customer's 80 (its answer is reached).
MIN_REASONING = 8
MAX_REASONING = 48
# A top-2 logit gap under this is a near tie another engine's kernels may break the other way: the
# logits are bf16, one step of which is 0.031 nat at their magnitude (2-8 nats).
SAFE_GAP_NATS = 0.04
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


def hand_over(tensors: dict[str, torch.Tensor], token: int) -> dict[str, torch.Tensor]:
    """`</think>` takes `token`'s lm_head row, `token` gets a zero one."""
    head = tensors["lm_head.weight"].clone()
    head[THINK_END_ID] = head[token]
    head[token] = 0
    return {**tensors, "lm_head.weight": head}


def write(directory: Path, tokenizer: Tokenizer, tensors: dict[str, torch.Tensor]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tiny.write_json(directory / "config.json", tiny.target_config())
    tiny.write_json(directory / "tokenizer_config.json", tokenizer_config())
    tokenizer.save(str(directory / "tokenizer.json"))
    save_file(tensors, str(directory / "model.safetensors"))


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
        self.prompt: list[int] = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        self.max_tokens = int(request["max_tokens"])

    def run(self, directory: Path, tensors: dict[str, torch.Tensor]) -> tuple[list[int], list[float]]:
        """The greedy answer's token ids and the top-2 logit gap at each of its steps."""
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig.from_pretrained(str(directory))
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
        model.load_state_dict(tensors)
        ids = list(self.prompt)
        answer: list[int] = []
        gaps: list[float] = []
        with torch.no_grad():
            for _ in range(self.max_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                top = torch.topk(logits, 2)
                answer.append(int(top.indices[0]))
                gaps.append(float(top.values[0] - top.values[1]))
                ids.append(answer[-1])
        return answer, gaps


def choose_handover(probe: Probe, directory: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The token X whose row `</think>` takes, and where the probe's reasoning then ends."""
    answer, gaps = probe.run(directory, tensors)
    safe = next((step for step, gap in enumerate(gaps) if gap < SAFE_GAP_NATS), len(gaps))
    last = min(MAX_REASONING, safe - 1, len(answer) - 2)  # at least one answer token after `</think>`
    for step in range(last, MIN_REASONING - 1, -1):
        token = answer[step]
        if token in answer[:step]:
            continue
        handed, _ = probe.run(directory, hand_over(tensors, token))
        ends_once = handed.count(THINK_END_ID) == 1
        if handed[:step] == answer[:step] and handed[step] == THINK_END_ID and ends_once:
            return {
                "handed_over_token_id": token,
                "probe_reasoning_tokens": step,
                "probe_answer_tokens": len(handed) - step - 1,
                "probe_prompt_tokens": len(probe.prompt),
                "probe_min_gap_nats_before_end": min(gaps[: step + 1]),
            }
    raise SystemExit(
        f"no token of the probe's greedy answer between steps {MIN_REASONING} and {last} can end the "
        f"reasoning exactly once (first near tie at step {safe}); change MIN_REASONING or the seed"
    )


def generate(output: Path, request: dict[str, Any]) -> dict[str, Any]:
    staging = output.with_name(output.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    tokenizer = train_tokenizer()
    tensors = base_weights()
    write(staging, tokenizer, tensors)
    probe = Probe(staging, request)
    report = choose_handover(probe, staging, tensors)
    report.update({"think_start_id": THINK_START_ID, "think_end_id": THINK_END_ID})
    save_file(hand_over(tensors, report["handed_over_token_id"]), str(staging / "model.safetensors"))
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
